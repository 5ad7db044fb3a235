//! Sequences: `next` against `next_block(1000)` per id handed out, and
//! "sequence `next` + insert" against the optimistic insert loop, each
//! inserting documents under fresh numeric ids, with 1 and 16 writers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use mongodb::bson::doc;
use mongodb::event::EventHandler;
use mongodb::event::command::CommandEvent;
use mongodb::{Client, Collection};
use tally::{InsertLoop, SequenceConfig, Sequences, Store};

use crate::Settings;
use crate::measure::{Run, bench_options, merge, ms, server, timed};

const BLOCK: u32 = 1000;

pub async fn run(settings: &Settings) {
    let (uri, _server) = server();
    let mut options = bench_options(&uri).await;
    // Count the loop's inserts as the server sees them: every lost race is
    // one insert more than the documents stored.
    let loop_inserts = Arc::new(AtomicU64::new(0));
    let counter = loop_inserts.clone();
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(started) = event
            && started.command_name == "insert"
            && started
                .command
                .get_str("insert")
                .is_ok_and(|c| c.starts_with("by_loop_"))
        {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }));
    let client = Client::with_options(options.clone()).expect("client");
    let db_name = "tally_bench_sequence";
    client
        .database(db_name)
        .drop()
        .await
        .expect("drop bench database");
    let store = Store::from_parts(client.clone(), &options, db_name);
    let sequences = Arc::new(Sequences::new(&store, &SequenceConfig::default()));

    println!(
        "sequence: {} interleaved slices x {:?} per side, retryWrites=false",
        settings.rounds, settings.run
    );
    per_id_cost(&sequences, settings).await;
    for writers in [1usize, 16] {
        ids_for_inserts(
            &client,
            &store,
            &sequences,
            &loop_inserts,
            writers,
            settings,
        )
        .await;
    }
}

/// Ids handed out per second: one `next` per id, or one `next_block` per
/// 1000 ids.
async fn per_id_cost(sequences: &Arc<Sequences>, settings: &Settings) {
    let mut singles = Vec::new();
    let mut blocks = Vec::new();
    for round in 0..settings.rounds {
        for side in [round % 2, 1 - round % 2] {
            let seq = sequences.clone();
            if side == 0 {
                singles.push(
                    timed(1, settings.run, move |_, _| {
                        let seq = seq.clone();
                        async move {
                            seq.next("single").await.expect("next");
                        }
                    })
                    .await,
                );
            } else {
                blocks.push(
                    timed(1, settings.run, move |_, _| {
                        let seq = seq.clone();
                        async move {
                            seq.next_block("block", BLOCK).await.expect("next_block");
                        }
                    })
                    .await,
                );
            }
        }
    }
    let (single, block) = (merge(singles), merge(blocks));
    let single_ids = single.per_second();
    let block_ids = block.per_second() * f64::from(BLOCK);
    println!("\nids handed out, 1 writer:");
    println!(
        "  next              {single_ids:>12.0} ids/s   p50 {:.2} ms per call",
        ms(single.percentile(50.0))
    );
    println!(
        "  next_block({BLOCK})  {block_ids:>12.0} ids/s   p50 {:.2} ms per call",
        ms(block.percentile(50.0))
    );
    println!(
        "  next_block is {:.0}x cheaper per id (target >= 100x)",
        block_ids / single_ids
    );
}

/// Documents inserted per second under fresh ids: `next` then insert, or
/// the optimistic loop (highest id + 1, retry on a duplicate).
async fn ids_for_inserts(
    client: &Client,
    store: &Store,
    sequences: &Arc<Sequences>,
    loop_inserts: &AtomicU64,
    writers: usize,
    settings: &Settings,
) {
    let db = client.database("tally_bench_sequence");
    let inserts_before = loop_inserts.load(Ordering::Relaxed);
    let mut seq_runs = Vec::new();
    let mut loop_runs = Vec::new();
    for round in 0..settings.rounds {
        for side in [round % 2, 1 - round % 2] {
            if side == 0 {
                let coll: Collection<mongodb::bson::Document> =
                    db.collection(&format!("by_seq_{writers}"));
                let seq = sequences.clone();
                let name = format!("docs_{writers}");
                seq_runs.push(
                    timed(writers, settings.run, move |w, i| {
                        let (coll, seq, name) = (coll.clone(), seq.clone(), name.clone());
                        async move {
                            let id = seq.next(&name).await.expect("next");
                            coll.insert_one(doc! { "_id": id, "w": w as i64, "i": i as i64 })
                                .await
                                .expect("insert");
                        }
                    })
                    .await,
                );
            } else {
                let inserter =
                    InsertLoop::new(store, &format!("by_loop_{writers}")).max_attempts(10_000);
                loop_runs.push(
                    timed(writers, settings.run, move |w, i| {
                        let inserter = inserter.clone();
                        async move {
                            inserter
                                .insert(doc! { "w": w as i64, "i": i as i64 })
                                .await
                                .expect("optimistic insert");
                        }
                    })
                    .await,
                );
            }
        }
    }
    let (by_seq, by_loop) = (merge(seq_runs), merge(loop_runs));
    let inserts = loop_inserts.load(Ordering::Relaxed) - inserts_before;
    let lost = inserts.saturating_sub(by_loop.ops as u64);
    println!("\ninsert with a fresh id, {writers} writer(s):");
    print_row("next + insert", &by_seq);
    print_row("insert loop", &by_loop);
    println!(
        "  insert loop / next + insert = {:.2}x; the loop lost {lost} races ({:.2} per document)",
        by_loop.per_second() / by_seq.per_second(),
        lost as f64 / by_loop.ops.max(1) as f64
    );
}

fn print_row(kind: &str, run: &Run) {
    println!(
        "  {kind:<14} {:>8.0} docs/s   p50 {:>7.2} ms   p99 {:>7.2} ms",
        run.per_second(),
        ms(run.percentile(50.0)),
        ms(run.percentile(99.0))
    );
}
