//! Commands that stream work stop cleanly: `record --from` at an outage
//! (one message naming the hosts, a summary of what was and was not sent,
//! 69 or 75) and at Ctrl-C (the same summary, 130); sending the whole input
//! again afterwards counts every event once. `bench` names its scratch
//! collections on its first line and drops them at Ctrl-C.

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use mongodb::Collection;
use mongodb::bson::{Document, doc};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

use crate::cli::{tallyd, text, write_config};
use crate::common::proxy::{Action, Proxy, Rule, RuleGuard, upstream_of};
use crate::common::{TestContext, wait_until};

/// `n` events from `from` on: `{"event": "e<i>", "key": "k<i % 10>"}`.
fn events(from: usize, n: usize) -> String {
    (from..from + n)
        .map(|i| format!("{{\"event\": \"e{i}\", \"key\": \"k{}\"}}\n", i % 10))
        .collect()
}

/// A configuration for `uri` with the ledger of `views`: server selection
/// 2 s (an outage is found fast), attempts 60 s (a test server under load
/// may be slow; slow is not down).
fn config(uri: &str, database: &str) -> String {
    format!(
        "[mongodb]\nuri = \"{uri}\"\ndatabase = \"{database}\"\nserver_selection_timeout = \"2s\"\n\
         attempt_timeout = \"60s\"\n[[collections]]\nname = \"views\"\nledger = true\n"
    )
}

/// A test's database reached through a proxy, and a configuration file
/// ([`config`]) for it: the context, the proxy, the file's directory and
/// its path.
async fn behind_proxy(name: &str) -> (TestContext, Proxy, tempfile::TempDir, String) {
    let ctx = TestContext::new(name).await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(
        dir.path(),
        &config(&ctx.child_uri_through(&proxy, false), &ctx.db_name),
    );
    (ctx, proxy, dir, path)
}

/// The one error line of `shown`, which says the server at `address` is
/// unavailable.
fn one_unavailable_error<'a>(shown: &'a str, address: &str) -> &'a str {
    let errors: Vec<&str> = shown.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{shown}");
    assert!(errors[0].contains("the server is unavailable"), "{shown}");
    assert!(errors[0].contains(address), "{shown}");
    errors[0]
}

/// `tallyd --config <path> record --from - --collection views`, reading
/// the standard input the test writes.
fn record_from_stdin(path: &str) -> (Child, ChildStdin) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .args(["--config", path, "record", "--from", "-"])
        .args(["--collection", "views"])
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start tallyd");
    let stdin = child.stdin.take().expect("its standard input");
    (child, stdin)
}

/// Waits until `events` holds `n` documents.
async fn until_recorded(events: &Collection<Document>, n: u64) {
    wait_until(
        &format!("{n} events recorded"),
        Duration::from_secs(30),
        || async { events.count_documents(doc! {}).await.unwrap() >= n },
    )
    .await;
}

/// Sends SIGINT (Ctrl-C) to `child`.
fn interrupt(child: &Child) {
    let pid = child.id().expect("running").to_string();
    let sent = std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .expect("run kill");
    assert!(sent.success());
}

/// Waits (up to 30 s) for `child` to exit; its output.
async fn finished(child: Child) -> Output {
    tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("tallyd exits within 30 s")
        .expect("tallyd's output")
}

/// The number after `label` in `text` (`not sent: 12 lines` → 12).
fn number_after(text: &str, label: &str) -> u64 {
    let at = text
        .find(label)
        .unwrap_or_else(|| panic!("no {label:?} in {text}"));
    text[at + label.len()..]
        .trim_start()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number after {label:?} in {text}"))
}

/// 1,500 events recorded, then the server gone (the proxy the command
/// reaches it through closes): the next batch is the last one sent — one
/// message naming the proxy's address, a summary with the lines not sent
/// and the first of them, exit 69 (75 if an insert in flight may have
/// landed) — within one server selection. Before: every batch waited its
/// own, one line of output per event, exit 1. Then the whole input sent
/// again, as the summary says is safe: every event is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_from_stops_at_an_outage_and_sending_it_again_is_exact() {
    let (ctx, proxy, _dir, through) = behind_proxy("stream_outage").await;
    let address = proxy.address().to_string();
    let events_coll = ctx.client(false).await.collection("views_events");
    let (child, mut stdin) = record_from_stdin(&through);
    stdin.write_all(events(0, 1500).as_bytes()).await.unwrap();
    stdin.flush().await.unwrap();
    until_recorded(&events_coll, 1500).await;

    drop(proxy);
    let cut = Instant::now();
    stdin
        .write_all(events(1500, 1500).as_bytes())
        .await
        .unwrap();
    drop(stdin);
    let output = finished(child).await;
    let took = cut.elapsed();
    let shown = text(&output);
    one_unavailable_error(&shown, &address);
    assert!(shown.lines().count() < 10, "{shown}");
    assert!(took < Duration::from_secs(15), "took {took:?}: {shown}");
    let recorded = number_after(&shown, "-:");
    let unknown = number_after(&shown, "conflicts,");
    let not_sent = number_after(&shown, "not sent:");
    let first = number_after(&shown, "the first line");
    assert_eq!(recorded, 1500, "{shown}");
    assert_eq!(recorded + unknown + not_sent, 3000, "{shown}");
    assert!(first > 1500, "{shown}");
    let code = if unknown > 0 { 75 } else { 69 };
    assert_eq!(output.status.code(), Some(code), "{shown}");
    assert!(shown.contains("sending it all again is safe"), "{shown}");

    let direct = tempfile::tempdir().unwrap();
    let path = write_config(direct.path(), &config(&ctx.child_uri(false), &ctx.db_name));
    let file = direct.path().join("events.ndjson");
    std::fs::write(&file, events(0, 3000)).unwrap();
    let file = file.display().to_string();
    let args = ["--config", &path, "record", "--from", &file];
    let output = tallyd(&args, &[]).await;
    let shown = text(&output);
    assert_eq!(output.status.code(), Some(0), "{shown}");
    let recorded_now = number_after(&shown, "events.ndjson:");
    let duplicates = number_after(&shown, "recorded,");
    assert_eq!(recorded_now + duplicates, 3000, "{shown}");
    assert!(duplicates >= 1500, "{shown}");
    assert_eq!(events_coll.count_documents(doc! {}).await.unwrap(), 3000);
    for k in 0..10 {
        let key = format!("k{k}");
        let on_key = events_coll.count_documents(doc! { "k": &key }).await;
        assert_eq!(on_key.unwrap(), 300, "{key}");
    }
}

/// Ctrl-C (SIGINT) stops `record --from -` with its summary — what was
/// recorded, and that the rest of standard input was not sent, from which
/// line — and exit 130. Before, SIGINT ended it at once, summary-less.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_from_stops_at_ctrl_c_with_its_summary() {
    let ctx = TestContext::new("stream_ctrl_c").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &config(&ctx.child_uri(false), &ctx.db_name));
    let events_coll = ctx.client(false).await.collection("views_events");
    let (child, mut stdin) = record_from_stdin(&path);
    stdin.write_all(events(0, 20).as_bytes()).await.unwrap();
    stdin.flush().await.unwrap();
    until_recorded(&events_coll, 20).await;
    interrupt(&child);
    let output = finished(child).await;
    drop(stdin);
    let shown = text(&output);
    assert_eq!(output.status.code(), Some(130), "{shown}");
    assert!(shown.contains("-: 20 recorded, 0 duplicates"), "{shown}");
    assert!(
        shown.contains(
            "not sent: 0 lines and whatever standard input still holds, the first line 21"
        ),
        "{shown}"
    );
    assert!(shown.contains("sending it all again is safe"), "{shown}");
}

/// On a terminal `record --from FILE` shows a progress bar — the share of
/// the file done, the time left, the rate — and on a pipe only its summary
/// line. (The terminal is `script`'s pseudo-terminal.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_from_shows_a_progress_bar_on_a_terminal_only() {
    let ctx = TestContext::new("stream_progress").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &config(&ctx.child_uri(false), &ctx.db_name));
    let file = dir.path().join("events.ndjson");
    std::fs::write(&file, events(0, 3000)).unwrap();
    let file = file.display().to_string();
    let line = format!(
        "{} --config {path} record --from {file}",
        env!("CARGO_BIN_EXE_tallyd")
    );
    let output = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .await
        .expect("run script (util-linux)");
    let shown = text(&output);
    assert_eq!(output.status.code(), Some(0), "{shown}");
    assert!(shown.contains("100% ETA"), "{shown}");
    assert!(shown.contains("3000 lines, "), "{shown}");
    assert!(shown.contains("/s: 3000 recorded"), "{shown}");

    let output = tallyd(&["--config", &path, "record", "--from", &file], &[]).await;
    let shown = text(&output);
    assert_eq!(output.status.code(), Some(0), "{shown}");
    assert!(!shown.contains("ETA"), "{shown}");
    assert_eq!(shown.lines().count(), 1, "{shown}");
    assert!(shown.contains(": 0 recorded, 3000 duplicates"), "{shown}");
}

/// `bench` names its scratch collections on its first line, at once and on
/// a pipe (before, only in its report at the end); Ctrl-C stops it, exit
/// 130, and drops them — or, with `--keep`, leaves them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_names_its_collections_first_and_drops_them_at_ctrl_c() {
    let ctx = TestContext::new("stream_bench").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &ctx.config_toml(false, ""));
    let database = ctx.client(false).await.store().database().clone();
    for keep in [false, true] {
        let mut extra = vec!["--protocol", "plain,two-step"];
        if keep {
            extra.push("--keep");
        }
        let (child, mut stdout, first, name) = start_bench(&path, &extra).await;
        assert!(first.contains(&format!("{name}_events_fold")), "{first}");
        until_created(&database, &name).await;
        interrupt(&child);
        let mut rest = String::new();
        stdout.read_to_string(&mut rest).await.unwrap();
        let output = finished(child).await;
        let shown = format!("{first}{rest}{}", String::from_utf8_lossy(&output.stderr));
        assert_eq!(output.status.code(), Some(130), "{shown}");
        assert!(
            shown.contains("interrupted: the counters were not checked"),
            "{shown}"
        );
        let left: Vec<String> = database
            .list_collection_names()
            .await
            .unwrap()
            .into_iter()
            .filter(|n| n.starts_with(&name))
            .collect();
        if keep {
            assert!(left.contains(&name), "--keep: {left:?}: {shown}");
            for collection in left {
                database
                    .collection::<Document>(&collection)
                    .drop()
                    .await
                    .unwrap();
            }
        } else {
            assert!(left.is_empty(), "dropped: {left:?}: {shown}");
        }
    }
}

/// A `tallyd reconcile` of three collections a, b, c through a proxy
/// that answers each command on one of them as a rule says.
struct Reconcile {
    _ctx: TestContext,
    proxy: Proxy,
    _rule: RuleGuard,
    _dir: tempfile::TempDir,
    child: Child,
}

impl Reconcile {
    /// Starts it with `args`, each command on `faulty` answered by `action`.
    async fn start(name: &str, faulty: &str, action: Action, args: &[&str]) -> Self {
        let ctx = TestContext::new(name).await;
        let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
        let dir = tempfile::tempdir().unwrap();
        let config = format!(
            "[mongodb]\nuri = \"{}\"\ndatabase = \"{}\"\nserver_selection_timeout = \"2s\"\n\
             attempt_timeout = \"60s\"\n[[collections]]\nname = \"a\"\n\
             [[collections]]\nname = \"b\"\n[[collections]]\nname = \"c\"\n",
            ctx.child_uri_through(&proxy, false),
            ctx.db_name
        );
        let path = write_config(dir.path(), &config);
        let rule = proxy.rule(Rule::any().collection(faulty).then(action));
        let child = Command::new(env!("CARGO_BIN_EXE_tallyd"))
            .args(["--config", &path, "reconcile"])
            .args(args)
            .env_clear()
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start tallyd reconcile");
        Self {
            _ctx: ctx,
            proxy,
            _rule: rule,
            _dir: dir,
            child,
        }
    }
}

/// A reconcile whose second collection finds the server unavailable
/// (NotWritablePrimary, the class of an outage) stops there: the third is
/// not tried — before, each collection after it waited out its own server
/// selection in an outage — the table says which, and it exits 69.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_stops_at_an_unavailable_server() {
    let unavailable = Action::error(10107, "NotWritablePrimary", &[]);
    let run = Reconcile::start("stream_reconcile_down", "b", unavailable, &["--json"]).await;
    let output = finished(run.child).await;
    assert_eq!(output.status.code(), Some(69), "{}", text(&output));
    let out = crate::cli::json(&output);
    assert_eq!(out["not_tried"], serde_json::json!(["c"]), "{out}");
    let collections = out["collections"].as_array().expect("collections");
    assert_eq!(collections.len(), 2, "{out}");
    assert_eq!(out["ok"], false, "{out}");
}

/// Ctrl-C stops a reconcile: the collections after the one running are not
/// tried, the summary says so, and it exits 130 (before: 1, and every
/// collection after it was still tried, each "interrupted").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_stops_at_ctrl_c() {
    let slow = Action::DelayReply(Duration::from_secs(2));
    let run = Reconcile::start("stream_reconcile_int", "a", slow, &[]).await;
    run.proxy
        .wait_until("a's first command", Duration::from_secs(30), |log| {
            log.iter().any(|e| e.collection.as_deref() == Some("a"))
        })
        .await;
    interrupt(&run.child);
    let output = finished(run.child).await;
    let shown = text(&output);
    assert_eq!(output.status.code(), Some(130), "{shown}");
    assert!(
        shown.contains("not tried (interrupted): b and c"),
        "{shown}"
    );
}

/// Starts `tallyd --config <path> bench --seconds 600 --writers 2 <extra>`
/// and reads its first line, which must come at once: the child, the rest
/// of its standard output, that line, and the scratch collection it names.
async fn start_bench(
    path: &str,
    extra: &[&str],
) -> (
    Child,
    BufReader<tokio::process::ChildStdout>,
    String,
    String,
) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .args([
            "--config",
            path,
            "bench",
            "--seconds",
            "600",
            "--writers",
            "2",
        ])
        .args(extra)
        .env_clear()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start tallyd bench");
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    tokio::time::timeout(Duration::from_secs(30), stdout.read_line(&mut first))
        .await
        .expect("a first line within 30 s")
        .unwrap();
    let name = first
        .strip_prefix("tallyd bench: scratch collections ")
        .and_then(|rest| rest.split(',').next())
        .unwrap_or_else(|| panic!("no collection named first: {first:?}"))
        .to_owned();
    assert!(name.starts_with("tally_bench_"), "{first}");
    (child, stdout, first, name)
}

/// Waits until the collection `name` exists.
async fn until_created(database: &mongodb::Database, name: &str) {
    wait_until(
        &format!("{name} written"),
        Duration::from_secs(30),
        || async {
            let names = database.list_collection_names().await.unwrap();
            names.iter().any(|n| n == name)
        },
    )
    .await;
}

/// With the server gone mid-run (the proxy it reaches it through closes),
/// `bench` stops within a slice or two: one message naming the address and
/// why, what it measured, unchecked, and the scratch collections left to
/// drop; exit 69, or 75 when some increment's outcome is not known.
/// Before, every caller waited out its server selection slice after slice
/// for the whole run, then each open outcome its settling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_stops_at_an_outage() {
    let (ctx, proxy, _dir, path) = behind_proxy("stream_bench_down").await;
    let address = proxy.address().to_string();
    let database = ctx.client(false).await.store().database().clone();
    let (child, mut stdout, first, name) = start_bench(&path, &["--protocol", "plain"]).await;
    until_created(&database, &name).await;
    drop(proxy);
    let cut = Instant::now();
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).await.unwrap();
    let output = finished(child).await;
    let took = cut.elapsed();
    let stderr = String::from_utf8_lossy(&output.stderr);
    let shown = format!("{first}{rest}{stderr}");
    let error = one_unavailable_error(&shown, &address);
    assert!(error.contains(&format!("collections {name},")), "{shown}");
    assert!(
        matches!(output.status.code(), Some(69 | 75)),
        "{:?}: {shown}",
        output.status
    );
    assert!(took < Duration::from_secs(20), "took {took:?}: {shown}");
    for collection in database.list_collection_names().await.unwrap() {
        if collection.starts_with(&name) {
            database
                .collection::<Document>(&collection)
                .drop()
                .await
                .unwrap();
        }
    }
}

/// With no server at all, `record --from FILE` sends its first batch, finds
/// the server unreachable, and stops: exit 69, nothing sent, the first line
/// not sent is line 1, and the URI's password is never shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_from_with_no_server_sends_nothing_and_hides_the_password() {
    let port = crate::common::tallyd::free_address().port();
    let uri = format!("mongodb://tally:S3cret-pw@127.0.0.1:{port}/?directConnection=true");
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &config(&uri, "app"));
    let file = dir.path().join("events.ndjson");
    std::fs::write(&file, events(0, 2500)).unwrap();
    let file = file.display().to_string();
    let output = tallyd(&["--config", &path, "record", "--from", &file], &[]).await;
    let shown = crate::errors::readable(&output);
    assert_eq!(output.status.code(), Some(69), "{shown}");
    one_unavailable_error(&shown, &format!("127.0.0.1:{port}"));
    assert!(
        shown.contains("0 recorded, 0 duplicates, 0 conflicts, 0 unknown"),
        "{shown}"
    );
    assert!(
        shown.contains("not sent: 2500 lines, the first line 1"),
        "{shown}"
    );
    assert!(!shown.contains("S3cret-pw"), "{shown}");

    // In JSON: no object for a line not sent, one summary object.
    let args = ["--config", &path, "record", "--from", &file, "--json"];
    let output = tallyd(&args, &[]).await;
    let shown = crate::errors::readable(&output);
    assert_eq!(output.status.code(), Some(69), "{shown}");
    let out = crate::cli::json(&output);
    assert_eq!(out["outcome"], "unavailable", "{out}");
    assert_eq!(out["not_sent"], 2500, "{out}");
    assert_eq!(out["first_not_sent_line"], 1, "{out}");
    let error = out["error"].as_str().unwrap_or_default();
    assert!(error.contains(&format!("127.0.0.1:{port}")), "{out}");
    assert!(!shown.contains("S3cret-pw"), "{shown}");
}

/// A second Ctrl-C stops a reconcile at once, without waiting for the
/// command in flight (here a reply held for 60 s): the first one says that
/// it stops in order, and how to stop at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ctrl_c_stops_a_reconcile_at_once() {
    let held = Action::DelayReply(Duration::from_secs(60));
    let mut run = Reconcile::start("stream_reconcile_int2", "a", held, &[]).await;
    run.proxy
        .wait_until("a's first command", Duration::from_secs(30), |log| {
            log.iter().any(|e| e.collection.as_deref() == Some("a"))
        })
        .await;
    let mut stderr = BufReader::new(run.child.stderr.take().unwrap());
    interrupt(&run.child);
    let said = tokio::time::timeout(Duration::from_secs(30), async {
        let mut line = String::new();
        while !line.contains("interrupted: stopping in order") {
            line.clear();
            assert!(
                stderr.read_line(&mut line).await.unwrap() > 0,
                "stderr ended"
            );
        }
        line
    })
    .await
    .expect("the first Ctrl-C is said within 30 s");
    assert!(said.contains("Ctrl-C again to stop at once"), "{said}");
    let again = Instant::now();
    interrupt(&run.child);
    let output = finished(run.child).await;
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).await.unwrap();
    assert_eq!(output.status.code(), Some(130), "{rest}");
    assert!(
        rest.contains("interrupted again: stopping at once"),
        "{rest}"
    );
    assert!(again.elapsed() < Duration::from_secs(20), "{rest}");
}

/// An outage that comes late in a long `record --from -`: "has not
/// answered for" counts from the outage, not from the start of the
/// command, and says that each operation (not the command) gives up after
/// the selection timeout. Before, 6 s into the command it said "for 8s" two
/// seconds into the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_late_in_a_long_command_is_timed_from_the_outage() {
    let ctx = TestContext::new("stream_outage_late").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let dir = tempfile::tempdir().unwrap();
    let settings = config(&ctx.child_uri_through(&proxy, false), &ctx.db_name).replace(
        "server_selection_timeout = \"2s\"",
        "server_selection_timeout = \"8s\"",
    );
    let path = write_config(dir.path(), &settings);
    let events_coll = ctx.client(false).await.collection("views_events");
    let started = Instant::now();
    let (child, mut stdin) = record_from_stdin(&path);
    stdin.write_all(events(0, 10).as_bytes()).await.unwrap();
    stdin.flush().await.unwrap();
    until_recorded(&events_coll, 10).await;
    // The command has run a while when the outage comes.
    while started.elapsed() < Duration::from_secs(6) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(proxy);
    let cut = Instant::now();
    stdin.write_all(events(10, 10).as_bytes()).await.unwrap();
    drop(stdin);
    let output = finished(child).await;
    let since_cut = cut.elapsed();
    let shown = text(&output);
    let said: Vec<Duration> = shown
        .lines()
        .filter(|l| l.contains("has not answered for "))
        .map(|line| {
            assert!(line.contains("each operation gives up after 8s"), "{line}");
            line.split("has not answered for ")
                .nth(1)
                .and_then(|rest| rest.split(" (").next())
                .and_then(|d| humantime::parse_duration(d).ok())
                .unwrap_or_else(|| panic!("a duration in {line}"))
        })
        .collect();
    assert!(!said.is_empty(), "it said it waits: {shown}");
    for said in said {
        assert!(
            said <= since_cut,
            "{said:?} said, {since_cut:?} since the cut: {shown}"
        );
    }
}
