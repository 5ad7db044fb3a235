//! The events ledger under the adversarial review of issue 21 (r21): each
//! test is one finding, numbered by severity, and fails on the code it
//! reviewed (merge db045a8). The command line's findings are in `cli`.
//!
//! Time is moved by the `now` each fold step is given (the server's clock
//! plus hours or days), as `ledger_prune` does; inserts are held up in the
//! network by the black-pipe proxy. The oracle is what the test recorded
//! and what is stored, never what the code under test reports.

mod cli;

use std::time::{Duration, SystemTime};

use mongodb::bson::doc;
use tally::{EventTicket, Ledger, Reconciler, Recording, Store};
use tokio_util::sync::CancellationToken;

use crate::common::proxy::{Action, Proxy, Release, Rule, upstream_of};
use crate::common::{TestContext, counter};
use crate::ledger::{assert_outcome, fold_of, ledger_on, ledger_through_proxy};

const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);

/// The server's clock.
async fn server_now(store: &Store) -> SystemTime {
    Reconciler::new(store)
        .server_time()
        .await
        .expect("server time")
}

/// Records `event` through `recorder` while the proxy holds its insert up
/// in the network (the first attempt) and cuts its retry: the caller is
/// told unknown, and the insert lands when the test releases it.
async fn record_held(
    proxy: &Proxy,
    recorder: &Ledger,
    event: &str,
    key: &str,
    amount: i64,
) -> EventTicket {
    let _held = [
        proxy.rule(
            Rule::command("insert")
                .collection("views_events")
                .nth(1)
                .then(Action::HoldRequest(Release::WhenReleased)),
        ),
        proxy.rule(
            Rule::command("insert")
                .collection("views_events")
                .nth(2)
                .then(Action::CloseBeforeForwarding),
        ),
    ];
    match recorder.record(event, key, amount).await {
        Recording::Unknown(ticket) => ticket,
        other => panic!("expected unknown, got {other:?}"),
    }
}

/// Records `event` through `recorder` while the proxy lets both attempts
/// land and loses both replies: unknown, and in the log.
async fn landed_unknown(proxy: &Proxy, recorder: &Ledger, event: &str) -> EventTicket {
    let _lost = [
        proxy.rule(Rule::command("insert").nth(1).then(Action::DropReply)),
        proxy.rule(Rule::command("insert").nth(2).then(Action::DropReply)),
    ];
    match recorder.record(event, "home", 1).await {
        Recording::Unknown(ticket) => ticket,
        other => panic!("expected unknown, got {other:?}"),
    }
}

/// A ledger of `views` whose counters refuse to pass 5 (a validator),
/// folded through a proxy that can stop a pass before its commit.
struct HeldRig {
    ctx: TestContext,
    direct: crate::common::TestClient,
    ledger: Ledger,
    proxy: Proxy,
    fold: tally::EventFold,
}

impl HeldRig {
    async fn new(name: &str) -> Self {
        let ctx = TestContext::new(name).await;
        let direct = ctx.client(false).await;
        direct
            .client
            .database(&ctx.db_name)
            .run_command(doc! { "create": "views", "validator": { "counter": { "$lte": 5 } } })
            .await
            .unwrap();
        let ledger = ledger_on(&direct.store(), "views").await;
        let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
        let fold = fold_of(&ctx.client_through(&proxy, false).await.store(), "views");
        Self {
            ctx,
            direct,
            ledger,
            proxy,
            fold,
        }
    }

    fn counters(&self) -> mongodb::Collection<mongodb::bson::Document> {
        self.direct.collection("views")
    }

    async fn pass(&self) -> Result<tally::EventsRun, tally::Error> {
        self.fold
            .fold(SystemTime::now(), &CancellationToken::new())
            .await
    }

    /// A pass stops before its commit (a daemon restarted, the network).
    async fn pass_stopped_before_its_commit(&self) {
        let _crash = self.proxy.rule(
            Rule::command("update")
                .collection("views_events_fold")
                .mentions("$unset")
                .then(Action::CloseBeforeForwarding),
        );
        assert!(
            self.pass().await.is_err(),
            "the pass stops before its commit"
        );
    }

    /// The validator goes: the counter takes any sum.
    async fn fix_the_counter(&self) {
        self.direct
            .client
            .database(&self.ctx.db_name)
            .run_command(doc! { "collMod": "views", "validator": {} })
            .await
            .unwrap();
    }

    /// A few passes later, the counter `big` holds `total` and nothing is
    /// held.
    async fn takes_its_events(&self, total: i64) {
        let mut run = self.pass().await.expect("a pass");
        for _ in 0..3 {
            run = self.pass().await.expect("a pass");
        }
        assert_eq!(self.ledger.value("big").await.unwrap().value, total);
        assert_eq!(
            counter(&self.counters(), "big").await,
            total,
            "the fixed counter takes its events: {run:?}"
        );
        assert!(run.backlog.held.is_empty(), "nothing is held: {run:?}");
    }
}

/// Finding 1 (lost for good). A recorder's lane whose first inserts were
/// all duplicates (a consumer replaying a queue's already-recorded
/// events) has nothing folded, so the fold state keeps no folded number
/// for it. Its next insert is held up in the network past the lane's
/// seal; the fold seals the lane (an empty survey) and forgets it. The
/// insert then lands, `record_again` finds it and says `recorded` — and
/// nothing ever counts it: the sweep only looks for late events on lanes
/// that have a folded number, so no pass, no sweep, no exact read ever
/// sees this lane again. The design's limit promises such an insert is
/// "folded only when the sweep finds it, late"; it is never found.
#[tokio::test]
async fn a_late_insert_on_a_sealed_lane_that_never_folded_an_event_is_counted() {
    let ctx = TestContext::new("review_ledger_late_unfolded_lane").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let (proxy, recorder) = ledger_through_proxy(&ctx).await;
    let ledger = Ledger::new(&store, recorder.spec().clone());
    // Another process recorded the replayed event first.
    assert_outcome(&ledger.record("replayed", "a", 1).await, "recorded");
    // The recorder's lane is minted and registered; its insert stops at
    // the duplicate: nothing of its own lands on it.
    assert_outcome(&recorder.record("replayed", "a", 1).await, "duplicate");
    let ticket = record_held(&proxy, &recorder, "late", "a", 10).await;

    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    let now = server_now(&store).await;
    fold.fold(now, &stop).await.expect("a pass");
    // Two hours on, a pass raises the floor past the held insert's number.
    fold.fold(now + 2 * HOUR, &stop).await.expect("a pass");
    // The held insert reaches the server, which refuses it (the floor):
    // the ticket sent again records the event, on a fresh number.
    let released = proxy.release_held().await;
    assert!(released.iter().any(|e| e.server_replied), "{released:?}");
    let again = recorder
        .record_again(ticket)
        .await
        .expect("within the horizon");
    assert_outcome(&again, "recorded");
    let stored = || async {
        direct
            .collection("views_events")
            .count_documents(doc! { "_id": "late" })
            .await
            .unwrap()
    };
    assert_eq!(stored().await, 1, "the late event is in the log");

    // Pass after pass, sweep after sweep, past the dedupe window.
    for later in [3 * HOUR, 8 * DAY, 30 * DAY] {
        fold.sweep(now + later).await.expect("a sweep");
        fold.fold(now + later, &stop).await.expect("a pass");
    }
    // Folded, then deleted a dedupe window after its lane was sealed again.
    assert_eq!(
        stored().await,
        0,
        "the late event is deleted past the window"
    );
    assert_eq!(
        counter(&direct.collection("views"), "a").await,
        11,
        "30 days on, the fold has counted the recorded event"
    );
    assert_eq!(
        ledger.value("a").await.unwrap().value,
        11,
        "an exact read counts the recorded event"
    );
}

/// Finding 2 (a fixed counter blocked for good by a crash). A counter
/// refused its sum (held at pass 1), and was fixed. The next pass sends
/// the held sum (position 1) and the counter's new sum (position 2): both
/// apply. The pass stops before its commit (a daemon restarted, a network
/// failure at the commit) and is resumed: the held sum, still in the
/// state, goes out again at position 1 — the counter's fold lane holds 2
/// — and comes back `OutOfOrder`, which the fold takes for a refusal
/// ("its fold state was reset"), not for what it is here (applied before
/// the newer one, the only order the fold sends in). It is held again,
/// for good; every later sum of the counter waits behind it. The counter
/// never counts again; `events_held` blames a reset that never happened.
#[tokio::test]
async fn a_pass_resumed_after_a_fixed_counter_took_its_held_sum_never_blocks_the_counter() {
    let rig = HeldRig::new("review_ledger_resumed_held").await;
    assert_outcome(&rig.ledger.record("s1", "big", 8).await, "recorded");
    let run = rig.pass().await.expect("a pass");
    assert_eq!(run.backlog.held.len(), 1, "refused and held: {run:?}");
    rig.fix_the_counter().await;
    assert_outcome(&rig.ledger.record("s2", "big", 1).await, "recorded");
    rig.pass_stopped_before_its_commit().await;
    assert_eq!(counter(&rig.counters(), "big").await, 9);
    rig.pass().await.expect("the pass resumed");
    assert_outcome(&rig.ledger.record("s3", "big", 1).await, "recorded");
    rig.takes_its_events(10).await;
}

/// Finding 3 (`not_recorded` for an event that landed). `record_again`
/// sends an unknown event again; when that resend is refused — its fresh
/// lane's registration fails (a network failure, twice), or its insert
/// meets a command error — the outcome is `NotRecorded`: "definitely not
/// recorded: nothing was written". But the ticket's first attempt landed
/// (or still may: it can be held up in the network), and the fold counts
/// it. A resend can never say more than "unknown" about the attempts
/// before it — the lanes protocol's resume says exactly that.
#[tokio::test]
async fn a_refused_resend_of_an_unknown_event_is_unknown_never_not_recorded() {
    let ctx = TestContext::new("review_ledger_resend_refused").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let (proxy, recorder) = ledger_through_proxy(&ctx).await;
    // A resend that goes through finds the earlier attempt's landing.
    let ticket = landed_unknown(&proxy, &recorder, "evt_1").await;
    let again = recorder
        .record_again(ticket)
        .await
        .expect("within the horizon");
    // The resend's insert meets a command error.
    let ticket = landed_unknown(&proxy, &recorder, "evt_2").await;
    assert_outcome(&recorder.record("warm", "other", 1).await, "recorded");
    let again_2 = {
        let _refused = proxy.rule(Rule::command("insert").nth(1).then(Action::error(
            13,
            "Unauthorized",
            &[],
        )));
        recorder
            .record_again(ticket)
            .await
            .expect("within the horizon")
    };
    let fold = fold_of(&store, "views");
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("a pass");
    assert_eq!(
        counter(&direct.collection("views"), "home").await,
        2,
        "both events landed and count"
    );
    assert_eq!(
        (again.name(), again_2.name()),
        ("recorded", "unknown"),
        "two landed events told not recorded: {again:?} / {again_2:?}"
    );
}

/// Finding 4 (a ticket settled on the wrong ledger). An `EventTicket`
/// does not name its events collection, so `record_again` takes another
/// ledger's ticket — a retry queue shared by two ledgers, a ticket pasted
/// into the wrong handle — and records the event there. The first insert
/// had landed in `views_events`: the event is now counted on both ledgers'
/// counters, and the caller was told `recorded`. (Lane tickets refuse
/// another collection before anything is sent since the ticket review.)
#[tokio::test]
async fn a_ticket_is_refused_by_another_ledger_before_anything_is_sent() {
    let ctx = TestContext::new("review_ledger_ticket_elsewhere").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let (proxy, views) = ledger_through_proxy(&ctx).await;
    let clicks = ledger_on(&store, "clicks").await;
    let ticket = landed_unknown(&proxy, &views, "evt_1").await;
    let landed = direct
        .collection("views_events")
        .count_documents(doc! { "_id": "evt_1" })
        .await
        .unwrap();
    assert_eq!(landed, 1, "the first attempt landed in views_events");
    let settled = clicks.record_again(ticket).await;
    let written = direct
        .collection("clicks_events")
        .count_documents(doc! {})
        .await
        .unwrap();
    assert_eq!(
        written, 0,
        "the views event was recorded in clicks_events too ({settled:?}): counted on two ledgers"
    );
    assert!(settled.is_err(), "refused: {settled:?}");
}

/// Finding 5 (the dedupe window shrinks by a recorder's clock error). An
/// event's age is read from its number, the recorder's clock; the sweep
/// deletes a lane's folded events once that number is older than
/// `event_retention` by the server's clock. A recorder host whose clock is
/// two hours behind (a hardware clock kept in local time, a stalled NTP)
/// has its events forgotten two hours before the window ends, and a
/// redelivery inside the window is recorded and counted again — a day
/// behind, a day early; past the window, right after its lane is sealed.
/// The retention floor's hour covers resends within the retry horizon, not
/// this; nothing measures or alerts on a recorder's clock. (The server's
/// clock is moved here instead of the recorder's: the recorder records at
/// the test's real time, the server reads two hours later.)
#[tokio::test]
async fn a_redelivery_inside_the_window_is_a_duplicate_whatever_the_recorders_clock() {
    let ctx = TestContext::new("review_ledger_recorder_behind").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    // Numbers are the server's clock: the recorder's own clock takes no
    // part (the processes of `clocks::…` run minutes off).
    assert_outcome(&ledger.record("evt_1", "a", 1).await, "recorded");
    let server = server_now(&store).await;
    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    fold.fold(server, &stop).await.expect("a pass");
    fold.fold(server + 2 * HOUR, &stop).await.expect("a pass");
    // Six days and 23 hours after it was recorded (the window is 7 days),
    // the queue delivers the event again, to another consumer.
    let inside = server + 7 * DAY - HOUR;
    fold.sweep(inside).await.expect("a sweep");
    let consumer = Ledger::new(&store, ledger.spec().clone());
    let again = consumer.record("evt_1", "a", 1).await;
    fold.fold(inside, &stop).await.expect("a pass");
    assert_eq!(
        counter(&direct.collection("views"), "a").await,
        1,
        "the event, delivered again inside the dedupe window, was counted twice ({again:?})"
    );
    assert_outcome(&again, "duplicate");
}

/// Finding 6 (counted a week late, invisible meanwhile). An insert held up
/// in the network a few minutes past its lane's end lands after the fold
/// sealed the lane. The design says only an insert held "longer than an
/// hour past its lane's end is folded only when the sweep finds it, late";
/// but the sweep looks for late events only on lanes whose folded number is
/// older than the whole dedupe window (7 days by default). Until then the
/// event — `recorded`, says `record_again` — is in no counter, in no exact
/// read (`get`), and in no backlog or alert.
#[tokio::test]
async fn a_late_insert_on_a_sealed_lane_is_counted_and_read_before_the_window_passes() {
    let ctx = TestContext::new("review_ledger_late_sealed_lane").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let (proxy, recorder) = ledger_through_proxy(&ctx).await;
    let ledger = Ledger::new(&store, recorder.spec().clone());
    assert_outcome(&recorder.record("first", "a", 1).await, "recorded");
    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    let now = server_now(&store).await;
    fold.fold(now, &stop).await.expect("a pass");
    let ticket = record_held(&proxy, &recorder, "late", "a", 10).await;
    fold.fold(now + 2 * HOUR, &stop).await.expect("a pass");
    let released = proxy.release_held().await;
    assert!(released.iter().any(|e| e.server_replied), "{released:?}");
    let again = recorder
        .record_again(ticket)
        .await
        .expect("within the horizon");
    assert_outcome(&again, "recorded");

    assert_eq!(
        ledger.value("a").await.unwrap().value,
        11,
        "an exact read counts the recorded event"
    );
    // An hour later (three past the lane's registration), sweep and pass.
    fold.sweep(now + 3 * HOUR).await.expect("a sweep");
    let run = fold.fold(now + 3 * HOUR, &stop).await.expect("a pass");
    assert_eq!(
        counter(&direct.collection("views"), "a").await,
        11,
        "the late event is folded within hours, not after the dedupe window: {run:?}"
    );
}

/// Finding 7 (a counter blocked for good after it was fixed). Negative
/// amounts are events too (a refund): a held sum can come to zero — the
/// counter refused +8 (a validator), and a later -8 was merged into it.
/// A zero sum is sent and refused by the lanes protocol ("the amount must
/// not be zero"); once a pass was resumed (any transient failure, any
/// crash before the commit) that refusal is "maybe applied", so nothing is
/// ever merged into it again, and it can never be taken. After the
/// counter is fixed, every later sum of it waits behind that zero for
/// good: the counter never gets its events, and `events_held` blames the
/// counter ("the amount must not be zero") for what is the fold's own.
#[tokio::test]
async fn a_held_sum_that_comes_to_zero_never_blocks_its_counter_once_the_counter_is_fixed() {
    let rig = HeldRig::new("review_ledger_zero_held").await;
    assert_outcome(&rig.ledger.record("sale", "big", 8).await, "recorded");
    let run = rig.pass().await.expect("a pass");
    assert_eq!(run.backlog.held.len(), 1, "refused and held: {run:?}");
    assert_outcome(&rig.ledger.record("refund", "big", -8).await, "recorded");
    let run = rig.pass().await.expect("a pass");
    assert_eq!(run.backlog.held.len(), 1, "merged: {run:?}");
    assert_eq!(run.backlog.held[0].amount, "0", "{run:?}");
    rig.pass_stopped_before_its_commit().await;
    rig.pass().await.expect("the pass resumed");
    rig.fix_the_counter().await;
    assert_outcome(&rig.ledger.record("sale2", "big", 3).await, "recorded");
    rig.takes_its_events(3).await;
}

/// Finding 8 (the fold state dropped by hand). The design says dropping
/// `<events>_fold` "would fold the events still kept again". It does the
/// opposite, silently: passes are numbered from 1 again, so a counter whose
/// fold lane holds an old pass takes a new pass of the same number as
/// "counted earlier" and drops its events without a word; and the lanes
/// registered before the drop are known to no one any more, so what the
/// running recorders record on them is never surveyed, never in an exact
/// read, never in the backlog. A fold that cannot count must say so
/// (refuse, alert); it must not report a clean pass while dropping
/// recorded events, nor an exact read lie.
#[tokio::test]
async fn a_dropped_fold_state_never_drops_recorded_events_in_silence() {
    let ctx = TestContext::new("review_ledger_state_dropped").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    for i in 0..3 {
        assert_outcome(&ledger.record(format!("e{i}"), "a", 1).await, "recorded");
    }
    fold.fold(SystemTime::now(), &stop).await.expect("a pass");
    assert_eq!(counter(&direct.collection("views"), "a").await, 3);

    direct
        .collection("views_events_fold")
        .drop()
        .await
        .expect("drop the fold state");
    // The running process goes on recording on its lane; a new process
    // records on a fresh one.
    assert_outcome(&ledger.record("e3", "a", 1).await, "recorded");
    assert_outcome(&ledger.record("e4", "a", 1).await, "recorded");
    let other = Ledger::new(&store, ledger.spec().clone());
    assert_outcome(&other.record("e5", "a", 1).await, "recorded");

    let mut refused = false;
    for _ in 0..3 {
        match fold.fold(SystemTime::now(), &stop).await {
            Ok(run) => assert!(
                run.backlog.events + run.backlog.held_events() > 0
                    || counter(&direct.collection("views"), "a").await == 6,
                "a clean pass, nothing left, nothing held, and the counter at {}: three recorded \
                 events dropped in silence ({run:?})",
                counter(&direct.collection("views"), "a").await
            ),
            Err(_) => refused = true,
        }
    }
    match ledger.value("a").await {
        Ok(exact) => assert_eq!(exact.value, 6, "an exact read is exact or refused"),
        Err(err) => assert!(refused, "the read refuses ({err}) but the fold did not"),
    }
}

/// Finding 9 (cost grows with recorder processes, not events). Every
/// handle mints a lane, and a lane stays registered (surveyed by every
/// pass, read by every exact read) for an hour and more, and keeps an
/// entry in the state document's `folded` map for the whole dedupe window.
/// `tallyd record` is one process — one lane — per event; so is a
/// serverless webhook handler making its `Ledger` per invocation. With the
/// 120 recorder processes of two minutes at one event a second, one exact
/// read of one counter sends 125 commands (one `find` per live lane, plus
/// every registration read twice), and a pass with nothing to fold 605
/// (four survey probes and a backlog count per lane); with the hour's
/// 4,000 live lanes, thirty times that. At that rate the `folded` map gains 86,400 entries a day, each
/// kept 7 days (34 bytes each: 20 MB, past the 16 MB document limit, in
/// under 6 days, after which no commit fits). The design promises "exact
/// reads cost the counter document plus that counter's events not yet
/// folded".
#[tokio::test]
async fn an_exact_read_and_an_idle_pass_cost_the_same_with_many_recorder_processes() {
    let ctx = TestContext::new("review_ledger_many_lanes").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    for i in 0..120 {
        // One short-lived recorder process per event.
        let process = Ledger::new(&store, ledger.spec().clone());
        assert_outcome(&process.record(format!("e{i}"), "a", 1).await, "recorded");
    }
    let fold = fold_of(&store, "views");
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("a pass");
    client.events.clear();
    assert_eq!(ledger.value("a").await.unwrap().value, 120);
    let read = client.events.sent().len();
    client.events.clear();
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("an idle pass");
    let idle = client.events.sent().len();
    assert!(
        read <= 10,
        "one exact read of one counter sent {read} commands (an idle pass: {idle})"
    );
    // A pass asks each live lane (registered within its span) whether it
    // holds events above its folded number: one index seek each, and one
    // more each for the backlog's metric. It grows with the recorder
    // processes of the last hour, never with the events kept (one
    // aggregate over every lane would be one command, but on a server that
    // does not bound each branch by the index it reads every event kept).
    assert!(
        idle <= 2 * 121 + 10,
        "a pass with nothing to fold sent {idle} commands"
    );
}

/// Finding 11 (one counter stops its ledger, on the project's own test
/// server). Events whose amounts sum past 2^63 in one pass: the design
/// counts on `$sum` turning an int64 overflow into a double (real MongoDB
/// does), which sends the counter to the exact sum and holds it. The test
/// server answers the `$group` with `InternalError` instead, so the pass
/// fails, and every pass after it, for every counter of the ledger: `b`
/// is never folded. The fold's isolation of one bad counter hangs on one
/// server's `$sum`; summing as decimals (exact to 34 digits), or falling
/// back to the exact sum when the `$group` fails, would not.
#[tokio::test]
async fn amounts_summing_past_2_63_in_one_pass_never_stop_the_other_counters() {
    let ctx = TestContext::new("review_ledger_sum_overflow").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    assert_outcome(&ledger.record("big1", "a", i64::MAX).await, "recorded");
    assert_outcome(&ledger.record("big2", "a", 1).await, "recorded");
    assert_outcome(&ledger.record("small", "b", 1).await, "recorded");
    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    let mut last = None;
    for _ in 0..3 {
        last = Some(fold.fold(SystemTime::now(), &stop).await);
    }
    assert_eq!(
        counter(&direct.collection("views"), "b").await,
        1,
        "the other counter is folded: {last:?}"
    );
    let run = last.expect("three passes").expect("the pass holds a's sum");
    assert_eq!(run.backlog.held.len(), 1, "{run:?}");
    assert_eq!(
        run.backlog.held[0].amount,
        (i128::from(i64::MAX) + 1).to_string()
    );
}

/// Finding 12 (an exact read the fold contradicts). An event written by
/// hand from the shell carries its amount as a double (`n: 2`) — the case
/// the design reads and reports. The fold sums only int32 and int64
/// amounts and leaves the double out as malformed; the exact read counts
/// it (`integer_value` takes an integral double). So `get` says 3, the
/// pass runs, and `get` says 1 with nothing new recorded: one of the two is
/// untrue.
#[tokio::test]
async fn an_exact_read_and_the_fold_agree_on_an_amount_stored_as_a_double() {
    let ctx = TestContext::new("review_ledger_double_amount").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    assert_outcome(&ledger.record("e1", "a", 1).await, "recorded");
    let events = direct.collection("views_events");
    let first = events
        .find_one(doc! { "_id": "e1" })
        .await
        .unwrap()
        .unwrap();
    // The next number on the same lane, as the shell writes it.
    events
        .insert_one(doc! {
            "_id": "by_hand", "k": "a", "n": 2.0,
            "at": mongodb::bson::DateTime::now(),
            "L": first.get_object_id("L").unwrap(),
            "s": first.get_i64("s").unwrap() + 1,
        })
        .await
        .unwrap();
    let before = ledger.value("a").await.unwrap().value;
    let fold = fold_of(&store, "views");
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("a pass");
    let after = ledger.value("a").await.unwrap().value;
    assert_eq!(
        before, after,
        "nothing was recorded between the two reads, yet the exact value moved"
    );
    assert_eq!(
        counter(&direct.collection("views"), "a").await,
        after,
        "the counter is what the exact read said"
    );
}
