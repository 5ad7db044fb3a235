//! Exactly once through the network: clients that send every request
//! again until they get its answer, through a proxy that drops answers
//! after the daemon acted, cuts connections while requests are on their
//! way, and holds answers past the client's timeout. Events go one by one
//! and in batches, over several keys of a collection and over the minute
//! buckets of another, while the daemon folds them. At the end every
//! counter equals its distinct events, and every answer a client got was
//! true: counted events were said counted, at most one answer per event
//! said `recorded` (only one insert can land), none said anything else.
//!
//! `TALLY_API_EVENTS` sets how many events (default 2,000; the issue's
//! proof is `TALLY_API_EVENTS=20000`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::{ApiDaemon, Setup, specs};
use tally::Ledger;

/// How many events: `TALLY_API_EVENTS`, default 2,000.
fn events() -> usize {
    std::env::var("TALLY_API_EVENTS").map_or(2000, |n| {
        n.parse().expect("TALLY_API_EVENTS is a whole number")
    })
}

/// The client's timeout; the proxy holds some answers longer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);
const HELD: Duration = Duration::from_millis(2500);
/// Concurrent clients.
const CLIENTS: usize = 8;

/// What the proxy did, by kind.
#[derive(Default)]
struct Faults {
    forwarded: AtomicU64,
    dropped: AtomicU64,
    held: AtomicU64,
    cut: AtomicU64,
}

/// A proxy between the clients and the API that injects faults: per
/// answer, 8% dropped (the connection closed instead), 4% held past the
/// client's timeout; per chunk of a request, 3% of connections cut before
/// it is forwarded.
struct FaultyProxy {
    address: SocketAddr,
    faults: Arc<Faults>,
    stop: CancellationToken,
}

impl FaultyProxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let faults = Arc::new(Faults::default());
        let stop = CancellationToken::new();
        let (shared, stopped) = (faults.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = stopped.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((client, _)) = accepted else { continue };
                let faults = shared.clone();
                tokio::spawn(relay(client, upstream, faults));
            }
        });
        Self {
            address,
            faults,
            stop,
        }
    }

    fn said(&self) -> String {
        let f = &self.faults;
        format!(
            "forwarded {}, dropped {}, held {}, cut {}",
            f.forwarded.load(Ordering::Relaxed),
            f.dropped.load(Ordering::Relaxed),
            f.held.load(Ordering::Relaxed),
            f.cut.load(Ordering::Relaxed)
        )
    }
}

impl Drop for FaultyProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One client connection, relayed until either side closes or a fault
/// ends it.
async fn relay(client: TcpStream, upstream: SocketAddr, faults: Arc<Faults>) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let (mut client_in, mut client_out) = client.into_split();
    let (mut server_in, mut server_out) = server.into_split();
    let cut = CancellationToken::new();
    let requests = {
        let (faults, cut) = (faults.clone(), cut.clone());
        async move {
            let mut chunk = vec![0u8; 64 * 1024];
            loop {
                let n = match client_in.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if fastrand::u32(..100) < 3 {
                    faults.cut.fetch_add(1, Ordering::Relaxed);
                    cut.cancel();
                    return;
                }
                if server_out.write_all(&chunk[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    let answers = {
        let cut = cut.clone();
        async move {
            let mut buffer = Vec::new();
            let mut chunk = vec![0u8; 64 * 1024];
            loop {
                while let Some(length) = response_length(&buffer) {
                    let response: Vec<u8> = buffer.drain(..length).collect();
                    match fastrand::u32(..100) {
                        0..8 => {
                            faults.dropped.fetch_add(1, Ordering::Relaxed);
                            cut.cancel();
                            return;
                        }
                        8..12 => {
                            faults.held.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(HELD).await;
                        }
                        _ => {
                            faults.forwarded.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    if client_out.write_all(&response).await.is_err() {
                        return;
                    }
                }
                match server_in.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                }
            }
        }
    };
    // Either direction ending (or a fault) closes both: dropping the
    // halves closes the sockets.
    tokio::select! {
        () = requests => {}
        () = answers => {}
        () = cut.cancelled() => {}
    }
}

/// The length of the first whole HTTP response in `buffer` (headers and a
/// `Content-Length` body), if it is all there.
fn response_length(buffer: &[u8]) -> Option<usize> {
    let end = buffer.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&buffer[..end]).ok()?;
    let length: usize = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    (buffer.len() >= end + length).then_some(end + length)
}

/// One event of the workload: its id, collection, key, amount and time.
#[derive(Clone)]
struct Planned {
    id: String,
    collection: &'static str,
    key: String,
    by: i64,
    at: Option<String>,
}

impl Planned {
    fn body(&self) -> Value {
        let mut body = json!({ "event": self.id, "key": self.key, "by": self.by });
        if let Some(at) = &self.at {
            body["at"] = json!(at);
        }
        body
    }
}

/// Every answer each event got that said what became of it.
type Answers = Arc<Mutex<HashMap<String, Vec<String>>>>;

/// The workload: `n` events over 8 keys of `orders` and 4 keys of `calls`
/// (their time within the last 20 seconds: the current and last minute's
/// buckets), amounts 1 to 3.
fn plan(n: usize) -> Vec<Planned> {
    (0..n)
        .map(|i| {
            let bucketed = fastrand::bool();
            let at = bucketed.then(|| {
                let ago = Duration::from_millis(fastrand::u64(..20_000));
                humantime::format_rfc3339_millis(SystemTime::now() - ago).to_string()
            });
            Planned {
                id: format!("ev-{i}"),
                collection: if bucketed { "calls" } else { "orders" },
                key: if bucketed {
                    format!("line-{}", fastrand::u8(..4))
                } else {
                    format!("account-{}", fastrand::u8(..8))
                },
                by: fastrand::i64(1..=3),
                at,
            }
        })
        .collect()
}

/// Sends `events` (one collection's) as one request, again and again
/// until each has a definite answer. Panics on any answer that is not
/// true of an event sent with a fresh id.
async fn send_until_answered(
    client: &reqwest::Client,
    base: &str,
    mut events: Vec<Planned>,
    answers: &Answers,
) {
    let mut attempts = 0;
    while !events.is_empty() {
        attempts += 1;
        assert!(attempts < 200, "no answer after 200 attempts");
        let collection = events[0].collection;
        let url = format!("{base}/v1/{collection}/events");
        let body = if events.len() == 1 {
            events[0].body()
        } else {
            Value::Array(events.iter().map(Planned::body).collect())
        };
        let sent = client.post(&url).json(&body).send().await;
        let Ok(response) = sent else { continue };
        let status = response.status().as_u16();
        let Ok(text) = response.text().await else {
            continue;
        };
        let answer: Value = serde_json::from_str(&text)
            .unwrap_or_else(|err| panic!("an answer that is not JSON ({err}): {text}"));
        let outcomes: Vec<Value> = match (status, events.len()) {
            (200..=202, 1) => vec![answer],
            (200, _) => answer["outcomes"].as_array().unwrap().clone(),
            (503, _) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            _ => panic!("an answer no client of fresh events should get: {status} {answer}"),
        };
        let mut open = Vec::new();
        for (event, outcome) in events.into_iter().zip(outcomes) {
            let name = outcome["outcome"].as_str().unwrap().to_owned();
            match name.as_str() {
                "recorded" | "duplicate" => {
                    assert_eq!(outcome["event"], json!(event.id), "{outcome}");
                    answers
                        .lock()
                        .unwrap()
                        .entry(event.id)
                        .or_default()
                        .push(name);
                }
                "unknown" => open.push(event),
                "not_recorded"
                    if outcome["error"]
                        .as_str()
                        .is_some_and(|e| e.contains("unavailable")) =>
                {
                    open.push(event);
                }
                _ => panic!("an outcome no fresh event should get: {outcome}"),
            }
        }
        events = open;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retrying_client_through_a_faulty_network_counts_every_event_once() {
    let daemon = ApiDaemon::start("api_exactly_once", Setup::default()).await;
    let proxy = FaultyProxy::start(daemon.api).await;
    let base = format!("http://{}", proxy.address);
    let client = reqwest::Client::builder()
        .timeout(CLIENT_TIMEOUT)
        .build()
        .unwrap();
    let planned = plan(events());
    let answers: Answers = Arc::default();
    // The work: requests of one event, or batches of 2 to 20 of one
    // collection's, shared out to the clients.
    let mut units: Vec<Vec<Planned>> = Vec::new();
    let mut rest = planned.clone();
    while !rest.is_empty() {
        let size = if fastrand::bool() {
            1
        } else {
            fastrand::usize(2..=20)
        };
        let collection = rest[0].collection;
        let (mut unit, mut others) = (Vec::new(), Vec::new());
        for event in rest {
            if unit.len() < size && event.collection == collection {
                unit.push(event);
            } else {
                others.push(event);
            }
        }
        units.push(unit);
        rest = others;
    }
    let queue = Arc::new(Mutex::new(units));
    let started = Instant::now();
    let workers: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (queue, client, base, answers) =
                (queue.clone(), client.clone(), base.clone(), answers.clone());
            tokio::spawn(async move {
                loop {
                    let Some(unit) = queue.lock().unwrap().pop() else {
                        return;
                    };
                    send_until_answered(&client, &base, unit, &answers).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    let took = started.elapsed();

    // Every event has a true answer: counted, and `recorded` at most once.
    let answers = answers.lock().unwrap().clone();
    assert_eq!(answers.len(), planned.len(), "every event answered");
    for (id, said) in &answers {
        let recorded = said.iter().filter(|s| *s == "recorded").count();
        assert!(
            recorded <= 1,
            "{id} was said recorded {recorded} times: {said:?}"
        );
    }
    // Every counter equals its distinct events.
    let store = daemon.ctx.client(false).await.store();
    let [orders, calls, _] = specs().map(|spec| Ledger::new(&store, spec));
    let mut expected: HashMap<(String, String), i64> = HashMap::new();
    for event in &planned {
        *expected
            .entry((event.collection.to_owned(), event.key.clone()))
            .or_default() += event.by;
    }
    let hour = Duration::from_secs(3600);
    let (from, to) = (SystemTime::now() - hour, SystemTime::now() + hour);
    for ((collection, key), want) in &expected {
        let got = if collection == "orders" {
            orders.value(key.as_str()).await.unwrap().value
        } else {
            calls
                .values_between(key.as_str(), from, to, None)
                .await
                .unwrap()
                .total
        };
        assert_eq!(
            got,
            *want,
            "{collection}/{key}; the proxy: {}",
            proxy.said()
        );
    }
    assert_eq!(
        daemon.events("orders").await + daemon.events("calls").await,
        planned.len() as u64
    );
    let f = &proxy.faults;
    for (fault, count) in [("dropped", &f.dropped), ("held", &f.held), ("cut", &f.cut)] {
        assert!(
            count.load(Ordering::Relaxed) > 0,
            "no answer was {fault}: {}",
            proxy.said()
        );
    }
    eprintln!(
        "{} events in {took:?} through the proxy ({})",
        planned.len(),
        proxy.said()
    );
}
