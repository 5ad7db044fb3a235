//! What went wrong between tally and the server, in a few words: the
//! network's failures and replies that are not MongoDB's.

/// A reply the driver could not read, from the server `at`. An opcode
/// MongoDB never sends means whatever answered speaks another protocol
/// (an HTTP port, another service): said so, without the opcode.
pub(super) fn unreadable_reply(message: &str, at: &str) -> String {
    if message.starts_with("Invalid wire protocol opcode") {
        format!(
            "what answered{at} does not speak MongoDB's protocol: check that the connection \
             string names a MongoDB server's host and port"
        )
    } else {
        format!("the server's reply{at} could not be read: {message}")
    }
}

/// What went wrong on the network, in a few words.
pub(super) fn network_problem(err: &std::io::Error) -> String {
    use std::io::ErrorKind as Io;
    match err.kind() {
        Io::ConnectionRefused => "connection refused".to_owned(),
        Io::ConnectionReset => "the connection was reset".to_owned(),
        Io::ConnectionAborted | Io::BrokenPipe => "the connection broke".to_owned(),
        Io::UnexpectedEof => "the server closed the connection".to_owned(),
        Io::NotConnected => "not connected".to_owned(),
        Io::AddrNotAvailable => "the address is not available".to_owned(),
        Io::TimedOut => "no answer in time".to_owned(),
        _ => {
            let text = err.to_string();
            match text.strip_prefix("failed to lookup address information: ") {
                Some(why) => format!(
                    "the host name does not resolve ({}; check the host in the connection string)",
                    why.to_lowercase()
                ),
                None => format!("network error: {text}"),
            }
        }
    }
}
