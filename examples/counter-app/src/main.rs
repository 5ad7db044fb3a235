//! An application that counts with tally's library, built without the
//! daemon feature: it adds one to a counter and says exactly what happened.
//!
//! ```text
//! tally-counter-app [URI] [KEY]
//! ```
//!
//! The URI comes from the first argument, else from `TALLY_URI`; the
//! database from `TALLY_DATABASE` (default `app`); the counter is `KEY`
//! (default `home`) in the collection `page_views`. A pending increment is
//! completed at once, an unknown one resumed, as an application would.
//! Exit status: 0 counted, 1 not counted, 75 still pending or unknown (the
//! daemon's fold, or a later `resume`, settles it).

use std::process::ExitCode;

use tally::{CollectionConfig, Counters, Increment, Store, StoreConfig, WriterConfig};

/// `EX_TEMPFAIL`: the increment is not settled yet.
const EXIT_TEMPFAIL: u8 = 75;

#[tokio::main]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(uri) = args.next().or_else(|| std::env::var("TALLY_URI").ok()) else {
        eprintln!("usage: tally-counter-app URI [KEY] (or set TALLY_URI)");
        return ExitCode::from(2);
    };
    let key = args.next().unwrap_or_else(|| "home".to_owned());
    let database = std::env::var("TALLY_DATABASE").unwrap_or_else(|_| "app".to_owned());

    let store = match Store::connect(&StoreConfig::new(uri, database)).await {
        Ok(store) => store,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::FAILURE;
        }
    };
    let views = Counters::new(
        &store,
        CollectionConfig::new("page_views"),
        WriterConfig::default(),
    );
    // Settle what can be settled now: resume an unknown increment (within
    // the retry horizon), complete a pending one.
    let outcome = match views.increment(key.as_str(), 1).await {
        Increment::Unknown(unknown) => {
            let token = unknown.token();
            match views.resume(unknown).await {
                Ok(resumed) => resumed,
                // Refused: past the retry horizon, counted at most once.
                Err(err) => {
                    println!("unknown: page_views/{key} (token {token}): {err}");
                    return ExitCode::from(EXIT_TEMPFAIL);
                }
            }
        }
        other => other,
    };
    let outcome = match outcome {
        Increment::Pending(pending) => views.complete(pending).await.into(),
        other => other,
    };
    // What an operator pastes into `tallyd resume`, whose check makes sure
    // the key, amount and collection are this increment's.
    let ticket = match &outcome {
        Increment::Unknown(unknown) => views.ticket(unknown),
        _ => String::new(),
    };
    // End the driver's work in order before the runtime stops.
    drop(views);
    store.shutdown().await;
    match outcome {
        Increment::Counted(counted) => {
            println!("counted: page_views/{key} +1 (token {})", counted.token());
            ExitCode::SUCCESS
        }
        Increment::Pending(pending) => {
            println!(
                "pending: page_views/{key} +1 (token {}); the fold will count it",
                pending.token()
            );
            ExitCode::from(EXIT_TEMPFAIL)
        }
        Increment::Unknown(_) => {
            println!(
                "unknown: page_views/{key} +1 (ticket {ticket}); run `tallyd resume {key} \
                 {ticket} --collection page_views` within the retry horizon"
            );
            ExitCode::from(EXIT_TEMPFAIL)
        }
        Increment::NotCounted(not) => {
            println!("not counted: page_views/{key}: {}", not.cause());
            ExitCode::FAILURE
        }
    }
}
