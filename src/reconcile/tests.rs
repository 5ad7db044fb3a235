//! The fold against a server, beside its specification: the statements the
//! fold sends make the server do exactly what the model ([`model::plan`])
//! says, and a statement pins every entry it removes. The server is the
//! tests' SecantusDB (`scripts/install-test-server`), or the one
//! `TALLY_TEST_MONGODB_URI` names, as for the integration tests.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use mongodb::options::ClientOptions;
use mongodb::{Client, Collection};
use tokio_util::sync::CancellationToken;

use super::model::{self, Cutoffs};
use super::statement::statements;
use super::{FoldTarget, Mode, Reconciler};
use crate::store::Store;
use crate::token::Token;
use crate::write::counter::CollectionConfig;

// The integration tests' server: parts of it only they use.
#[allow(dead_code)]
#[path = "../../tests/integration/common/server.rs"]
mod server;

use server::{EXTERNAL_URI_VAR, ServerOptions, TestServer};

const GRACE: Duration = Duration::from_secs(15 * 60);
const LANE_TTL: Duration = Duration::from_secs(3600);

static SERVER: OnceLock<TestServer> = OnceLock::new();

/// A store on the database `unit_<name>` of the tests' server, dropped
/// first if a previous run left it behind.
async fn store(name: &str) -> Store {
    let uri = match std::env::var(EXTERNAL_URI_VAR) {
        Ok(uri) if !uri.is_empty() => uri,
        _ => SERVER
            .get_or_init(|| TestServer::start(&ServerOptions::default()))
            .uri(),
    };
    let options = ClientOptions::parse(&uri)
        .await
        .expect("parse the test URI");
    let client = Client::with_options(options.clone()).expect("build a client");
    let database = format!("unit_{name}");
    client
        .database(&database)
        .drop()
        .await
        .expect("drop the test database");
    Store::from_parts(client, &options, &database)
}

fn target(spec: CollectionConfig) -> FoldTarget {
    FoldTarget {
        spec,
        grace: GRACE,
        batch_size: 100,
    }
}

/// A token older than the grace.
fn stale() -> ObjectId {
    Token::created_at_time(SystemTime::now() - Duration::from_secs(3600)).object_id()
}

/// A token younger than the grace.
fn fresh() -> ObjectId {
    ObjectId::new()
}

/// A minted lane's key, expired for `LANE_TTL`.
fn expired() -> String {
    Token::created_at_time(SystemTime::now() - Duration::from_secs(48 * 3600))
        .object_id()
        .to_hex()
}

/// A minted lane's key, just created.
fn young() -> String {
    ObjectId::new().to_hex()
}

/// The field `field` of the document `id`.
async fn field(coll: &Collection<Document>, id: &str, field: &str) -> Option<Bson> {
    coll.find_one(doc! { "_id": id })
        .await
        .expect("find_one")
        .and_then(|d| d.get(field).cloned())
}

/// What `model::plan` says of a document as it was inserted.
fn plan_of(document: &Document, cutoff: ObjectId) -> Result<model::FoldPlan, model::Malformed> {
    model::plan(
        document.get("counter"),
        document.get("pending"),
        document.get("settled"),
        cutoff,
    )
}

/// Asserts that `after` is `original` folded as `plan` says — or, with no
/// work to do or a malformed document, untouched.
fn assert_folded_as_planned(
    original: &Document,
    after: &Document,
    plan: &Result<model::FoldPlan, model::Malformed>,
) {
    match plan {
        Ok(plan) if plan.has_work() => {
            assert_eq!(
                after.get("counter"),
                Some(&plan.counter),
                "counter of {original}"
            );
            for (field, kept) in [("pending", &plan.keep), ("settled", &plan.kept_markers)] {
                match after.get(field) {
                    None => assert!(kept.is_empty(), "{field} of {original}"),
                    Some(Bson::Array(now)) => assert_eq!(now, kept, "{field} of {original}"),
                    Some(other) => panic!("{field} became {other}"),
                }
            }
        }
        _ => assert_eq!(after, original, "nothing to do or malformed: untouched"),
    }
}

/// Random documents of every shape — repeated tokens, settle markers, large
/// arrays written in the prefix form — folded by the server: each ends
/// exactly as the model says, or byte-for-byte untouched.
#[tokio::test]
async fn the_server_does_what_the_model_says() {
    let store = store("fold_vs_model").await;
    let coll = store.collection("random");
    let mut rng = fastrand::Rng::with_seed(20261122);
    let mut docs: Vec<Document> = (0..300).map(|i| random_document(&mut rng, i)).collect();
    // Edge cases: a double counter whose exact result is just past 2^53
    // (its double sum would round back into range), or lands on it, or
    // stays below; a sum that overflows midway and comes back.
    let edge = 2f64.powi(53) - 1.0;
    docs.extend([
        doc! { "_id": 1000, "counter": edge, "pending": [{ "t": stale(), "n": 2i64 }] },
        doc! { "_id": 1001, "counter": edge, "pending": [{ "t": stale(), "n": 1i64 }] },
        doc! { "_id": 1004, "counter": edge - 1.0, "pending": [{ "t": stale(), "n": 1i64 }] },
        doc! { "_id": 1002, "counter": 0i64, "pending": [
            { "t": stale(), "n": i64::MAX }, { "t": stale(), "n": 1i64 }, { "t": stale(), "n": -1i64 },
        ] },
        doc! { "_id": 1003, "counter": 0i64, "pending": [
            { "t": stale(), "n": i64::MAX }, { "t": stale(), "n": -1i64 }, { "t": stale(), "n": 1i64 },
        ] },
        doc! { "_id": 1005, "counter": i32::MAX - 5, "pending": [
            { "t": stale(), "n": 1i64 << 33 }, { "t": stale(), "n": -(1i64 << 33) },
        ] },
        doc! { "_id": 1006, "counter": (1i64 << 62) + 5, "pending": [stale(), stale()] },
    ]);
    coll.insert_many(docs.clone()).await.unwrap();
    let reconciler = Reconciler::new(&store);
    let now = reconciler.server_time().await.unwrap();
    let cutoff = Token::cutoff(now - GRACE);
    let target = FoldTarget {
        batch_size: 17,
        ..target(CollectionConfig::new("random"))
    };
    let run = reconciler
        .reconcile(
            &target,
            Mode::Fold,
            now,
            &CancellationToken::new(),
            &mut |_| {},
        )
        .await;
    assert!(run.error.is_none(), "{:?}", run.error);
    assert_eq!((run.refused, run.concurrent_changes), (0, 0));
    let (mut folded, mut tokens, mut amount, mut malformed, mut large) = (0, 0, 0i64, 0, 0);
    let after: HashMap<i32, Document> = coll
        .find(doc! {})
        .await
        .unwrap()
        .try_collect::<Vec<_>>()
        .await
        .unwrap()
        .into_iter()
        .map(|d| (d.get_i32("_id").unwrap(), d))
        .collect();
    for original in &docs {
        let plan = plan_of(original, cutoff);
        assert_folded_as_planned(original, &after[&original.get_i32("_id").unwrap()], &plan);
        match &plan {
            Ok(plan) if plan.has_work() => {
                folded += 1;
                tokens += plan.stale_tokens;
                amount = amount.saturating_add(plan.stale_amount);
                large += u64::from(plan.stale.len() > 64);
            }
            Ok(_) => {}
            // The report reads only documents holding one of the fields.
            Err(_) => {
                malformed +=
                    u64::from(original.contains_key("pending") || original.contains_key("settled"))
            }
        }
    }
    assert_eq!(run.documents_folded, folded);
    assert_eq!((run.tokens_folded, run.amount_folded), (tokens, amount));
    assert_eq!(run.survey.malformed, malformed);
    assert!(
        folded > 50 && malformed > 20 && large > 5,
        "the sample covers every kind: {folded} folded, {malformed} malformed, {large} large"
    );

    // The same documents folded directly, as the daemon's repair folds
    // them: the same result.
    let direct = store.collection("random_direct");
    direct.insert_many(docs.clone()).await.unwrap();
    let direct_target = FoldTarget {
        spec: CollectionConfig::new("random_direct"),
        ..target
    };
    for chunk in docs.chunks(40) {
        let ids = chunk
            .iter()
            .map(|d| d.get("_id").unwrap().clone())
            .collect();
        reconciler
            .fold_documents(&direct_target, ids, now)
            .await
            .unwrap();
    }
    for original in &docs {
        let id = original.get_i32("_id").unwrap();
        let now_doc = direct.find_one(doc! { "_id": id }).await.unwrap().unwrap();
        assert_folded_as_planned(original, &now_doc, &plan_of(original, cutoff));
    }
}

fn random_document(rng: &mut fastrand::Rng, id: i32) -> Document {
    let mut d = doc! { "_id": id };
    match rng.u8(0..10) {
        0 => {}
        1 => {
            d.insert("counter", Bson::Int32(rng.i32(-1000..1000)));
        }
        2 => {
            d.insert("counter", Bson::Int32(i32::MAX - rng.i32(0..3)));
        }
        3 => {
            d.insert("counter", Bson::Int64(i64::MAX - rng.i64(0..3)));
        }
        4 => {
            d.insert("counter", Bson::Double(f64::from(rng.i32(-100..100))));
        }
        5 => {
            d.insert("counter", Bson::String("7".into()));
        }
        _ => {
            d.insert("counter", Bson::Int64(rng.i64(-1_000_000..1_000_000)));
        }
    }
    let token = |rng: &mut fastrand::Rng| if rng.bool() { stale() } else { fresh() };
    let mut tokens: Vec<(ObjectId, i64)> = Vec::new();
    let pending = match rng.u8(0..14) {
        0 => None,
        1 => Some(Bson::String("x".into())),
        2 => Some(Bson::Array(Vec::new())),
        size => {
            let len = if size <= 4 {
                rng.usize(65..200)
            } else {
                rng.usize(1..5)
            };
            let mut entries = Vec::with_capacity(len);
            for _ in 0..len {
                let entry = match rng.u8(0..24) {
                    0 if len < 10 => Bson::Null,
                    1 if len < 10 => Bson::Int32(3),
                    2 if len < 10 => Bson::Document(doc! { "t": token(rng), "n": 1.5 }),
                    // A token already in the array again, in another form.
                    3..=5 if !tokens.is_empty() => {
                        let (t, n) = tokens[rng.usize(..tokens.len())];
                        match (n, rng.bool()) {
                            (1, true) => Bson::ObjectId(t),
                            (n, _) => Bson::Document(doc! { "n": n, "t": t }),
                        }
                    }
                    0..=11 => {
                        let t = token(rng);
                        tokens.push((t, 1));
                        Bson::ObjectId(t)
                    }
                    12..=17 => {
                        let (t, n) = (token(rng), rng.i64(1..100));
                        tokens.push((t, n));
                        Bson::Document(doc! { "t": t, "n": n })
                    }
                    _ => {
                        let (t, n) = (token(rng), rng.i32(-5..-1));
                        tokens.push((t, i64::from(n)));
                        Bson::Document(doc! { "n": n, "t": t })
                    }
                };
                entries.push(entry);
            }
            Some(Bson::Array(entries))
        }
    };
    if let Some(p) = pending {
        d.insert("pending", p);
    }
    let settled = match rng.u8(0..6) {
        0 => Some(Bson::Array(Vec::new())),
        1 if rng.u8(0..4) == 0 => Some(Bson::Array(vec![Bson::ObjectId(stale())])),
        1..=2 => Some(Bson::Array(
            (0..rng.usize(1..4))
                .map(|_| {
                    // A marker of a token in the array (a settle counted
                    // it), or of another token, old or young.
                    let (t, n) = match tokens.is_empty() || rng.bool() {
                        true => (token(rng), rng.i64(1..9)),
                        false => tokens[rng.usize(..tokens.len())],
                    };
                    Bson::Document(doc! { "t": t, "n": n })
                })
                .collect(),
        )),
        _ => None,
    };
    if let Some(s) = settled {
        d.insert("settled", s);
    }
    d
}

/// The statement pins each removed entry's value as read: a write to that
/// lane since the read makes it match nothing (the document is read
/// again), and an entry added since is never removed.
#[tokio::test]
async fn a_lane_written_after_the_read_is_never_removed() {
    let store = store("prune_pinned").await;
    let views = store.collection("views");
    let (old, other) = (expired(), expired());
    let read = doc! { "_id": "k", "counter": 1i64, "lanes": { &old: 3i64, &other: 1i64 } };
    views.insert_one(&read).await.unwrap();
    let now = Reconciler::new(&store).server_time().await.unwrap();
    let cutoffs = Cutoffs {
        tokens: Token::cutoff(now - GRACE),
        lanes: Token::cutoff(now - LANE_TTL),
    };
    let statements = statements(&CollectionConfig::new("views"), &read, cutoffs).unwrap();
    let send = || async {
        store
            .database()
            .run_command(doc! { "update": "views", "updates": statements.clone() })
            .await
            .unwrap()
    };

    // Since the read: the expired lane wrote 4 (a late resume), and a new
    // lane wrote its first entry.
    let new = young();
    views
        .update_one(
            doc! { "_id": "k" },
            doc! { "$set": { format!("lanes.{old}"): 4i64, format!("lanes.{new}"): 1i64 },
            "$inc": { "counter": 2i64 } },
        )
        .await
        .unwrap();
    let reply = send().await;
    assert_eq!(reply.get_i32("nModified").unwrap(), 0, "{reply:?}");
    assert_eq!(
        field(&views, "k", "lanes").await,
        Some(Bson::Document(
            doc! { &old: 4i64, &other: 1i64, &new: 1i64 }
        ))
    );

    // Only the new lane since the read: the statement applies, and keeps it.
    views
        .update_one(
            doc! { "_id": "k" },
            doc! { "$set": { format!("lanes.{old}"): 3i64 } },
        )
        .await
        .unwrap();
    let reply = send().await;
    assert_eq!(reply.get_i32("nModified").unwrap(), 1, "{reply:?}");
    assert_eq!(
        field(&views, "k", "lanes").await,
        Some(Bson::Document(doc! { &new: 1i64 }))
    );
    assert_eq!(
        field(&views, "k", "counter").await,
        Some(Bson::Int64(3)),
        "pruning never counts"
    );
}
