//! `tallyd`: the daemon and its command line, all of it in the library
//! ([`tally::tallyd_main`]), where tests can drive it.

fn main() -> std::process::ExitCode {
    tally::tallyd_main()
}
