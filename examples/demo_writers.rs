//! Writers for `scripts/demo`: increment counters through tally's library,
//! some of them "crashing" between the two steps (step 1 only, the token
//! left in `pending`), then check that the counters came out exact.
//!
//! ```text
//! demo_writers write URI DATABASE COLLECTION --writers 8 --increments 40 --crash-every 7 --out expected.json
//! demo_writers check URI DATABASE COLLECTION --expected expected.json
//! ```

use std::collections::BTreeMap;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use futures::future::join_all;
use mongodb::bson::{Bson, Document, doc};
use mongodb::options::ClientOptions;
use tally::{CollectionConfig, Counters, Increment, Store, Token, WriterConfig};

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the writers and save the expected counters.
    Write {
        uri: String,
        database: String,
        collection: String,
        #[arg(long, default_value_t = 8)]
        writers: usize,
        #[arg(long, default_value_t = 40)]
        increments: usize,
        /// Every Nth increment crashes after step 1.
        #[arg(long, default_value_t = 7)]
        crash_every: usize,
        #[arg(long)]
        out: String,
    },
    /// Compare the counters with the expected ones; exit 1 on a mismatch.
    Check {
        uri: String,
        database: String,
        collection: String,
        #[arg(long)]
        expected: String,
    },
}

const KEYS: [&str; 4] = ["home", "pricing", "docs", "blog"];

#[tokio::main]
async fn main() -> ExitCode {
    match Args::parse().command {
        Command::Write {
            uri,
            database,
            collection,
            writers,
            increments,
            crash_every,
            out,
        } => {
            let options = ClientOptions::parse(&uri).await.expect("URI");
            let client = mongodb::Client::with_options(options.clone()).expect("client");
            let store = Store::from_parts(client.clone(), &options, &database);
            let counters = Counters::new(
                &store,
                CollectionConfig::new(&collection),
                WriterConfig::default(),
            );
            let raw = client
                .database(&database)
                .collection::<Document>(&collection);
            let tasks = (0..writers).map(|w| {
                let (counters, raw) = (counters.clone(), raw.clone());
                tokio::spawn(async move {
                    let mut totals: BTreeMap<String, i64> = BTreeMap::new();
                    let (mut counted, mut crashed) = (0, 0);
                    for i in 0..increments {
                        let key = KEYS[(w + i) % KEYS.len()];
                        let amount = 1 + (i % 3) as i64;
                        if (w * increments + i) % crash_every == crash_every - 1 {
                            // A writer crashing between the steps: step 1 only,
                            // with the entry a writer adds (a bare token for +1).
                            let token = Token::new().object_id();
                            let entry = match amount {
                                1 => Bson::ObjectId(token),
                                _ => Bson::Document(doc! { "t": token, "n": amount }),
                            };
                            raw.update_one(
                                doc! { "_id": key },
                                doc! { "$addToSet": { "pending": entry } },
                            )
                            .upsert(true)
                            .await
                            .expect("step 1");
                            crashed += 1;
                        } else {
                            match counters.increment(key, amount).await {
                                Increment::Counted(_) | Increment::Pending(_) => counted += 1,
                                other => panic!("demo increment not counted: {other:?}"),
                            }
                        }
                        *totals.entry(key.to_owned()).or_default() += amount;
                    }
                    (totals, counted, crashed)
                })
            });
            let mut expected: BTreeMap<String, i64> = BTreeMap::new();
            let (mut counted, mut crashed) = (0, 0);
            for result in join_all(tasks).await {
                let (totals, c, x) = result.expect("writer");
                counted += c;
                crashed += x;
                for (key, n) in totals {
                    *expected.entry(key).or_default() += n;
                }
            }
            std::fs::write(&out, serde_json::to_string(&expected).expect("json"))
                .expect("write expected");
            println!(
                "{counted} increments counted; {crashed} crashed after step 1 (their tokens wait in `pending`)"
            );
            ExitCode::SUCCESS
        }
        Command::Check {
            uri,
            database,
            collection,
            expected,
        } => {
            let client = mongodb::Client::with_uri_str(&uri).await.expect("client");
            let coll = client
                .database(&database)
                .collection::<Document>(&collection);
            let expected: BTreeMap<String, i64> =
                serde_json::from_str(&std::fs::read_to_string(&expected).expect("read expected"))
                    .expect("json");
            let mut exact = true;
            println!(
                "  {:<10} {:>8} {:>9} {:>8}",
                "key", "counter", "expected", "pending"
            );
            for (key, want) in &expected {
                let doc = coll
                    .find_one(doc! { "_id": key })
                    .await
                    .expect("read")
                    .unwrap_or_default();
                let got = doc
                    .get_i64("counter")
                    .or_else(|_| doc.get_i32("counter").map(i64::from))
                    .unwrap_or(0);
                let pending = doc.get_array("pending").map(|p| p.len()).unwrap_or(0);
                let ok = got == *want && pending == 0;
                exact &= ok;
                println!(
                    "  {key:<10} {got:>8} {want:>9} {pending:>8}  {}",
                    if ok { "exact" } else { "MISMATCH" }
                );
            }
            if exact {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
