//! Writer lanes (the book: design/lanes.md) against a real server: exact counts in one
//! round trip, the outcome the caller is told when attempts fail, resumes
//! that count once however often they run, named lanes that recognise a
//! redelivered position, and the limits the lane settings put on all that.
//!
//! The oracle is the number of increments made, the lane map (one entry
//! per handle, plus one per unknown outcome) and the server's own count of
//! the updates it received (fewer than the increments when groups form).

mod bench;
mod cli;
mod group;

use std::time::{Duration, SystemTime};

use futures::future::join_all;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use tally::{
    CollectionConfig, Counters, Error, ErrorClass, LaneId, LaneIncrement, LaneName, LaneTicket,
    Token, WriterConfig,
};

use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
use crate::common::{FailPoint, TestClient, TestContext, counter, field, wait_until};

fn lanes_of(client: &TestClient, name: &str, writer: WriterConfig) -> Counters {
    Counters::try_new(&client.store(), CollectionConfig::new(name), writer)
        .expect("valid lane settings")
}

#[track_caller]
fn assert_counted(outcome: &LaneIncrement, settled_earlier: bool) {
    match outcome {
        LaneIncrement::Counted(c) => assert_eq!(
            c.settled_earlier(),
            settled_earlier,
            "settled_earlier: {outcome:?}"
        ),
        other => panic!("expected counted, got {other:?}"),
    }
}

#[track_caller]
fn assert_out_of_order(outcome: &LaneIncrement, held: i64) {
    match outcome {
        LaneIncrement::OutOfOrder(behind) => assert_eq!(behind.held(), held, "{outcome:?}"),
        other => panic!("expected out of order (the lane holds {held}), got {other:?}"),
    }
}

/// The document's lane map, as `(lane, s)` pairs in stored order.
async fn lane_map(coll: &Collection<Document>, key: &str) -> Vec<(String, i64)> {
    match field(coll, key, "lanes").await {
        None => Vec::new(),
        Some(Bson::Document(map)) => map
            .iter()
            .map(|(lane, s)| {
                let s = match s {
                    Bson::Int64(s) => *s,
                    Bson::Int32(s) => i64::from(*s),
                    other => panic!("lane {lane} holds {other:?}"),
                };
                (lane.clone(), s)
            })
            .collect(),
        Some(other) => panic!("lanes is not a document: {other:?}"),
    }
}

#[tokio::test]
async fn one_writer_counts_exactly_through_one_lane_on_new_and_existing_counters() {
    let ctx = TestContext::new("lanes_sequential").await;
    let client = ctx.client(false).await;
    let views = lanes_of(&client, "views", WriterConfig::default());
    let coll = client.collection("views");
    coll.insert_one(doc! { "_id": "old", "counter": 7i64, "pending": [] })
        .await
        .unwrap();
    let mut last = (0, 0);
    for _ in 0..50 {
        let outcome = views.add("new", 1).await;
        assert_counted(&outcome, false);
        let position = outcome.position().unwrap();
        assert!(position > last.1, "s grows with every add");
        let other = views.add("old", -2).await;
        assert_counted(&other, false);
        assert_eq!(other.lane(), outcome.lane(), "one lane per handle");
        last = (position, other.position().unwrap());
    }
    // A number is the time of the write, in microseconds.
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64;
    assert!(
        (now - 60_000_000..=now).contains(&last.1),
        "{last:?} at {now}"
    );
    assert_eq!(counter(&coll, "new").await, 50);
    assert_eq!(counter(&coll, "old").await, 7 - 100);
    // One handle, one lane: one entry per counter, its last number.
    let (new_map, old_map) = (lane_map(&coll, "new").await, lane_map(&coll, "old").await);
    assert_eq!(new_map.len(), 1, "{new_map:?}");
    assert_eq!(new_map[0].1, last.0, "the lane's last number");
    assert_eq!(old_map, vec![(new_map[0].0.clone(), last.1)]);
    assert_eq!(
        field(&coll, "old", "pending").await,
        Some(Bson::Array(vec![])),
        "other fields are left alone"
    );
    // A new counter starts from the amount as `$inc` writes it.
    assert_eq!(field(&coll, "new", "counter").await, Some(Bson::Int32(50)));
}

/// Sixteen callers sharing one handle on one hot counter: their
/// increments leave in groups (fewer updates than increments), one entry
/// in the document, and the count is exact.
#[tokio::test]
async fn sixteen_callers_on_one_hot_key_count_exactly_in_groups_through_one_lane() {
    let ctx = TestContext::new("lanes_hot_key").await;
    let client = ctx.client(false).await;
    let views = lanes_of(&client, "views", WriterConfig::default());
    let per_writer = 25;
    let updates = client.events.count("update");
    let writers = (0..16).map(|_| {
        let views = views.clone();
        tokio::spawn(async move {
            for _ in 0..per_writer {
                assert_counted(&views.add("hot", 1).await, false);
            }
        })
    });
    for writer in join_all(writers).await {
        writer.expect("writer");
    }
    let coll = client.collection("views");
    assert_eq!(counter(&coll, "hot").await, 16 * per_writer);
    let map = lane_map(&coll, "hot").await;
    assert_eq!(map.len(), 1, "one handle, one entry: {map:?}");
    let stats = views.lane_stats();
    assert_eq!(stats.increments, 16 * per_writer as u64);
    let sent = client.events.count("update") - updates;
    assert_eq!(sent as u64, stats.updates, "one update per group");
    assert!(stats.group_size() > 2.0, "groups formed: {stats:?}");
}

/// One counter named three ways (int32, int64, double: one `_id` to the
/// server) is one queue: never two updates in flight on it, so every
/// increment counts once and the lane keeps one entry.
#[tokio::test]
async fn a_key_written_as_int_long_and_double_is_one_counter_and_one_queue() {
    let ctx = TestContext::new("lanes_canonical_key").await;
    let client = ctx.client(false).await;
    let views = lanes_of(&client, "views", WriterConfig::default());
    let keys = [Bson::Int32(5), Bson::Int64(5), Bson::Double(5.0)];
    let writers = (0..12).map(|i| {
        let (views, key) = (views.clone(), keys[i % 3].clone());
        tokio::spawn(async move {
            for _ in 0..10 {
                assert_counted(&views.add(key.clone(), 1).await, false);
            }
        })
    });
    for writer in join_all(writers).await {
        writer.expect("writer");
    }
    let coll = client.collection("views");
    let found = coll.find_one(doc! { "_id": 5 }).await.unwrap().unwrap();
    assert_eq!(
        found.get("counter").and_then(Bson::as_i32),
        Some(120),
        "{found}"
    );
    assert_eq!(coll.count_documents(doc! {}).await.unwrap(), 1);
    assert!(views.lane_stats().group_size() > 1.0);
}

#[tokio::test]
async fn custom_field_names_are_used() {
    let ctx = TestContext::new("lanes_custom_fields").await;
    let client = ctx.client(false).await;
    let spec = CollectionConfig::new("views")
        .with_fields("total", "inflight")
        .with_lanes_field("writers");
    let views = Counters::try_new(&client.store(), spec, WriterConfig::default()).unwrap();
    assert_counted(&views.add("k", 5).await, false);
    let found = client
        .collection("views")
        .find_one(doc! { "_id": "k" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.get("total"), Some(&Bson::Int32(5)));
    assert_eq!(found.get_document("writers").unwrap().len(), 1);
    assert!(!found.contains_key("lanes") && !found.contains_key("counter"));
}

/// Two lost connections in a row: the outcome is unknown, the lane is
/// retired (the next increment uses another), and resuming the ticket any
/// number of times — one after another, or all at once — counts it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_lost_connections_are_unknown_and_resuming_1_2_5_times_counts_once() {
    for retry_writes in [false, true] {
        for (runs, concurrent) in [(1, false), (2, false), (5, false), (2, true), (5, true)] {
            let name = format!("lanes_unknown_{retry_writes}_{runs}_{concurrent}");
            let ctx = TestContext::new(&name).await;
            let client = ctx.client(retry_writes).await;
            let views = lanes_of(&client, "views", WriterConfig::default());
            let warmup = views.add("warmup", 1).await;
            assert_counted(&warmup, false);
            let ticket = {
                let _fail = FailPoint::updates_cut(&ctx, 2).await;
                match views.add("k", 3).await {
                    LaneIncrement::Unknown(ticket) => ticket,
                    other => panic!("{name}: expected unknown, got {other:?}"),
                }
            };
            assert_eq!(
                ticket.cause().and_then(Error::class),
                Some(ErrorClass::Transient)
            );
            let next = views.add("k", 1).await;
            assert_ne!(
                next.lane(),
                Some(ticket.lane()),
                "{name}: the lane is retired for this counter"
            );
            let other = views.add("warmup", 1).await;
            assert_eq!(
                other.lane(),
                warmup.lane(),
                "{name}: and only for it: every other counter keeps the handle's lane"
            );
            let outcomes: Vec<LaneIncrement> = if concurrent {
                join_all((0..runs).map(|_| views.resume_lane(ticket.clone())))
                    .await
                    .into_iter()
                    .map(|r| r.expect("resume"))
                    .collect()
            } else {
                let mut outcomes = Vec::new();
                for _ in 0..runs {
                    outcomes.push(views.resume_lane(ticket.clone()).await.expect("resume"));
                }
                outcomes
            };
            let fresh = outcomes
                .iter()
                .filter(|o| matches!(o, LaneIncrement::Counted(c) if !c.settled_earlier()))
                .count();
            assert!(
                outcomes
                    .iter()
                    .all(|o| matches!(o, LaneIncrement::Counted(_))),
                "{name}: {outcomes:?}"
            );
            // The lost attempts never reached the server: one resume applied it.
            assert_eq!(fresh, 1, "{name}: {outcomes:?}");
            assert_eq!(
                counter(&client.collection("views"), "k").await,
                3 + 1,
                "{name}"
            );
        }
    }
}

/// The update applied, then its write concern failed with a transient code,
/// twice: the retry collides with what the first attempt wrote, and the
/// lane's entry says it applied — counted (earlier), not unknown.
#[tokio::test]
async fn a_write_concern_error_after_the_update_applied_is_resolved_by_the_lanes_entry() {
    let ctx = TestContext::new("lanes_wce_applied").await;
    let client = ctx.client(false).await;
    let views = lanes_of(&client, "views", WriterConfig::default());
    assert_counted(&views.add("warmup", 1).await, false);
    let outcome = {
        let _fail = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "times": 2 }),
            doc! {
                "failCommands": ["update"],
                "writeConcernError": { "code": 91, "codeName": "ShutdownInProgress", "errmsg": "x" },
            },
        )
        .await;
        views.add("k", 4).await
    };
    assert_counted(&outcome, true);
    assert_eq!(counter(&client.collection("views"), "k").await, 4);
}

/// The update applied and its reply was lost, then the retry's connection
/// was cut before it reached the server: unknown. Every resume finds the
/// lane holding its number: counted earlier, nothing added.
#[tokio::test]
async fn an_unknown_whose_update_applied_resumes_to_counted_earlier() {
    let ctx = TestContext::new("lanes_unknown_applied").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let views = lanes_of(&through, "views", WriterConfig::default());
    let lost = [
        proxy.rule(Rule::command("update").nth(1).then(Action::DropReply)),
        proxy.rule(
            Rule::command("update")
                .nth(2)
                .then(Action::CloseBeforeForwarding),
        ),
    ];
    let ticket = match views.add("k", 4).await {
        LaneIncrement::Unknown(ticket) => ticket,
        other => panic!("expected unknown, got {other:?}"),
    };
    drop(lost);
    let coll = ctx.client(false).await.collection("views");
    assert_eq!(
        counter(&coll, "k").await,
        4,
        "the first attempt applied, once"
    );
    for _ in 0..3 {
        assert_counted(&views.resume_lane(ticket.clone()).await.unwrap(), true);
    }
    assert_eq!(counter(&coll, "k").await, 4);
}

#[tokio::test]
async fn a_command_error_is_not_counted_and_the_lane_goes_on_with_its_next_number() {
    let ctx = TestContext::new("lanes_command_error").await;
    let client = ctx.client(false).await;
    let views = lanes_of(&client, "views", WriterConfig::default());
    let first = views.add("k", 1).await;
    assert_counted(&first, false);
    let refused = {
        let _fail = FailPoint::update_refused(&ctx).await;
        views.add("k", 1).await
    };
    let LaneIncrement::NotCounted(not) = &refused else {
        panic!("expected not counted, got {refused:?}");
    };
    assert_eq!(not.cause().class(), Some(ErrorClass::Command));
    assert_eq!(refused.lane(), first.lane(), "not retired");
    let next = views.add("k", 1).await;
    assert_counted(&next, false);
    assert_eq!(next.lane(), first.lane());
    assert!(next.position() > refused.position());
    let coll = client.collection("views");
    assert_eq!(counter(&coll, "k").await, 2);
    assert_eq!(lane_map(&coll, "k").await[0].1, next.position().unwrap());
}

/// Callers give up while their counter's update is held up on the server:
/// the one whose increment left with it shares its fate (counted, once,
/// when it lands), the one still waiting is taken out of the next group
/// (never counted), and the others go on — nothing is retired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_that_give_up_are_counted_only_if_their_increment_had_left() {
    let ctx = TestContext::new("lanes_dropped").await;
    let client = ctx.client(false).await;
    let views = lanes_of(&client, "views", WriterConfig::default());
    let first = views.add("k", 1).await;
    assert_counted(&first, false);
    let updates = client.events.count("update");
    let fail = FailPoint::set(
        &ctx,
        Bson::Document(doc! { "times": 1 }),
        doc! { "failCommands": ["update"], "blockConnection": true, "blockTimeMS": 2000 },
    )
    .await;
    let spawn_add = |amount: i64| {
        let views = views.clone();
        tokio::spawn(async move { views.add("k", amount).await })
    };
    let held = spawn_add(10);
    let events = client.events.clone();
    wait_until("the held update was sent", Duration::from_secs(10), || {
        let events = events.clone();
        async move { events.count("update") > updates }
    })
    .await;
    // Waits behind the held update, then gives up before it leaves.
    let waiting = spawn_add(1000);
    tokio::task::yield_now().await;
    held.abort();
    waiting.abort();
    assert!(held.await.unwrap_err().is_cancelled());
    assert!(waiting.await.unwrap_err().is_cancelled());
    let next = views.add("k", 100).await;
    assert_counted(&next, false);
    assert_eq!(next.lane(), first.lane(), "nothing was retired");
    drop(fail);
    let coll = client.collection("views");
    assert_eq!(
        counter(&coll, "k").await,
        111,
        "the held update landed first"
    );
    assert_eq!(lane_map(&coll, "k").await.len(), 1);
}

#[tokio::test]
async fn a_named_lane_counts_a_redelivered_position_once() {
    let ctx = TestContext::new("lanes_named").await;
    let client = ctx.client(false).await;
    let views = lanes_of(&client, "views", WriterConfig::default());
    let partition = LaneName::new("orders:3").unwrap();
    for offset in 0..5 {
        assert_counted(&views.add_from("k", 2, &partition, offset).await, false);
    }
    // The source delivers offsets 3 and 4 again (a consumer restarted
    // before committing them), then goes on. The lane holds 4: offset 3 is
    // behind it (counted, as every position was sent in order until
    // counted), offset 4 is the one it holds.
    assert_out_of_order(&views.add_from("k", 2, &partition, 3).await, 4);
    assert_counted(&views.add_from("k", 2, &partition, 4).await, true);
    assert_counted(&views.add_from("k", 2, &partition, 5).await, false);
    let coll = client.collection("views");
    assert_eq!(counter(&coll, "k").await, 12);
    assert_eq!(lane_map(&coll, "k").await, vec![("orders:3".into(), 5)]);
    // A resume of a named lane's ticket is the same redelivery.
    let ticket = LaneTicket::new("k", LaneId::Named(partition.clone()), 5, 2).unwrap();
    assert_counted(&views.resume_lane(ticket).await.unwrap(), true);
    let refused = views.add_from("k", 2, &partition, -1).await;
    assert!(
        matches!(&refused, LaneIncrement::NotCounted(n) if matches!(n.cause(), Error::InvalidArgument(_))),
        "{refused:?}"
    );
    assert!(LaneName::new(ObjectId::new().to_hex()).is_err());
    assert_eq!(counter(&coll, "k").await, 12);
}

/// A named lane's position that was refused (not counted) and is sent
/// again after a later position counted is not reported counted: the lane
/// holds the later position, and the position sent is out of order —
/// nothing is written, and the caller is told which position the lane holds.
#[tokio::test]
async fn a_position_sent_after_a_later_one_is_out_of_order_never_counted() {
    let ctx = TestContext::new("lanes_out_of_order").await;
    let client = ctx.client(false).await;
    let views = lanes_of(&client, "views", WriterConfig::default());
    let coll = client.collection("views");
    let lane = LaneName::new("orders:0").unwrap();
    assert_counted(&views.add_from("k", 1, &lane, 4).await, false);
    let refused = {
        let _fail = FailPoint::update_refused(&ctx).await;
        views.add_from("k", 10, &lane, 5).await
    };
    assert!(
        matches!(refused, LaneIncrement::NotCounted(_)),
        "{refused:?}"
    );
    assert_counted(&views.add_from("k", 100, &lane, 6).await, false);
    // The refused message is delivered again (a dead-letter replay), and
    // resumed as a ticket.
    let again = views.add_from("k", 10, &lane, 5).await;
    assert_out_of_order(&again, 6);
    let ticket = LaneTicket::new("k", LaneId::Named(lane.clone()), 5, 10).unwrap();
    assert_out_of_order(&views.resume_lane(ticket).await.unwrap(), 6);
    // The position the lane holds is the one counted earlier.
    assert_counted(&views.add_from("k", 100, &lane, 6).await, true);
    assert_eq!(counter(&coll, "k").await, 101, "position 5 was never added");
    assert_eq!(lane_map(&coll, "k").await, vec![("orders:0".into(), 6)]);
}

/// A double counter (the legacy shell writes `0` as one) is added to only
/// while the sum is exact as a double — the rule of step 2 and the fold: at
/// 2^53 a `$inc` would round the +1 away, and a fraction would not stay
/// exact. Such an add is not counted, writes nothing and is not sent again
/// and again; an integral double below that counts.
#[tokio::test]
async fn a_lane_add_to_a_double_counter_counts_only_while_the_sum_is_exact() {
    let ctx = TestContext::new("lanes_double").await;
    let client = ctx.client(false).await;
    let views = lanes_of(&client, "views", WriterConfig::default());
    let coll = client.collection("views");
    let edge = 9_007_199_254_740_992.0_f64; // 2^53
    coll.insert_many([
        doc! { "_id": "edge", "counter": edge },
        doc! { "_id": "below", "counter": edge - 2.0 },
        doc! { "_id": "fraction", "counter": 2.5 },
        doc! { "_id": "exact", "counter": 5.0 },
    ])
    .await
    .unwrap();
    for (key, amount) in [("edge", 1), ("edge", -1), ("below", 2), ("fraction", 1)] {
        let before = coll.find_one(doc! { "_id": key }).await.unwrap();
        let updates = client.events.count("update");
        let outcome = views.add(key, amount).await;
        assert!(
            matches!(&outcome, LaneIncrement::NotCounted(n) if matches!(n.cause(), Error::Malformed { .. })),
            "{key} {amount:+}: {outcome:?}"
        );
        assert!(
            client.events.count("update") - updates <= 2,
            "{key}: sent again and again"
        );
        let after = coll.find_one(doc! { "_id": key }).await.unwrap();
        assert_eq!(after, before, "{key} {amount:+}: nothing written");
    }
    assert_counted(&views.add("below", 1).await, false);
    assert_eq!(
        field(&coll, "below", "counter").await,
        Some(Bson::Double(edge - 1.0))
    );
    assert_counted(&views.add("exact", 1).await, false);
    assert_eq!(
        field(&coll, "exact", "counter").await,
        Some(Bson::Double(6.0))
    );
}

/// A minted lane's ticket is resumed only while the time in its number is
/// younger than the resume horizon — whatever the lane's own age; a ticket
/// of tally 0.1's pool (a count, not a time) by its lane's age.
#[tokio::test]
async fn resuming_a_lane_past_its_resume_horizon_is_refused_and_writes_nothing() {
    let ctx = TestContext::new("lanes_resume_horizon").await;
    let client = ctx.client(false).await;
    let views = lanes_of(&client, "views", WriterConfig::default());
    let coll = client.collection("views");
    coll.insert_one(doc! { "_id": "k", "counter": 1i64 })
        .await
        .unwrap();
    let micros = |t: SystemTime| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_micros() as i64
    };
    let day_ago = SystemTime::now() - Duration::from_secs(23 * 3600 + 1);
    let old_lane = LaneId::Minted(Token::created_at_time(day_ago).object_id());
    let fresh_lane = LaneId::Minted(ObjectId::new());
    for (lane, position) in [(old_lane, 1), (fresh_lane.clone(), micros(day_ago))] {
        let ticket = LaneTicket::new("k", lane, position, 5).unwrap();
        let refused = views.resume_lane(ticket).await;
        assert!(
            matches!(refused, Err(Error::LaneResumeHorizonExceeded { .. })),
            "{refused:?}"
        );
    }
    assert_eq!(
        coll.find_one(doc! {}).await.unwrap(),
        Some(doc! { "_id": "k", "counter": 1i64 }),
        "nothing written"
    );
    // Just inside the horizon it is resumed.
    let young = SystemTime::now() - Duration::from_secs(22 * 3600);
    let lane = LaneId::Minted(Token::created_at_time(young).object_id());
    let ticket = LaneTicket::new("k", lane, 1, 5).unwrap();
    assert_counted(&views.resume_lane(ticket).await.unwrap(), false);
    let ticket = LaneTicket::new("k", fresh_lane, micros(young), 5).unwrap();
    assert_counted(&views.resume_lane(ticket).await.unwrap(), false);
    assert_eq!(counter(&coll, "k").await, 11);
}

#[tokio::test]
async fn lane_settings_that_do_not_hold_together_are_refused() {
    let ctx = TestContext::new("lanes_bad_settings").await;
    let client = ctx.client(false).await;
    let bad = WriterConfig {
        group_max: 0,
        group_wait: Duration::from_secs(2),
        lane_resume_horizon: Duration::from_secs(3600),
        lane_ttl: Duration::from_secs(3600),
        ..WriterConfig::default()
    };
    let spec = CollectionConfig::new("views");
    let err = Counters::try_new(&client.store(), spec.clone(), bad).expect_err("refused");
    let message = err.to_string();
    for setting in ["group_max", "group_wait", "lane_ttl"] {
        assert!(
            message.contains(&format!("WriterConfig::{setting} ")),
            "{message}"
        );
    }
    // `new` builds the handle for the two-step increment, and refuses every
    // lane operation without writing.
    let views = Counters::new(&client.store(), spec, bad);
    let refused = views.add("k", 1).await;
    assert!(
        matches!(&refused, LaneIncrement::NotCounted(n) if n.cause().to_string() == message),
        "{refused:?}"
    );
    assert!(matches!(
        views.increment("k", 1).await,
        tally::Increment::Counted(_)
    ));
    assert_eq!(lane_map(&client.collection("views"), "k").await, vec![]);
    assert!(matches!(
        views.add("k", 0).await,
        LaneIncrement::NotCounted(_)
    ));
}
