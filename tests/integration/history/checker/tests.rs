//! The checker on hand-made histories: a good one passes, and each way a
//! history can go wrong is caught by the check that says so.

use std::time::Duration;

use mongodb::bson::oid::ObjectId;
use tally::{GiveBack, Take};

use super::super::record::{
    BoundedState, Call, FinalState, InsertSent, InsertedDoc, Op, Oracle, Outcome,
};
use super::{check, explain};

fn oid(n: u8) -> ObjectId {
    ObjectId::from_bytes([n; 12])
}

fn op(invoke: u64, ret: u64, call: Call, outcome: Outcome) -> Op {
    Op {
        process: "w0".into(),
        invoke: Duration::from_millis(invoke),
        ret: Duration::from_millis(ret),
        call,
        outcome,
    }
}

fn increment(invoke: u64, ret: u64, amount: i64, token: u8, outcome: Outcome) -> Op {
    let call = Call::Increment {
        key: "k".into(),
        amount,
        token: Some(oid(token)),
    };
    op(invoke, ret, call, outcome)
}

fn resume(invoke: u64, ret: u64, amount: i64, token: u8, outcome: Outcome) -> Op {
    let call = Call::Resume {
        key: "k".into(),
        token: oid(token),
        amount,
    };
    op(invoke, ret, call, outcome)
}

fn read(invoke: u64, ret: u64, value: i64) -> Op {
    op(
        invoke,
        ret,
        Call::Read { key: "k".into() },
        Outcome::Value(value),
    )
}

fn numbers(invoke: u64, ret: u64, n: u32, first: i64) -> Op {
    let name = "orders".to_owned();
    let call = if n == 1 {
        Call::Next { name }
    } else {
        Call::Block { name, n }
    };
    let last = first + i64::from(n) - 1;
    op(invoke, ret, call, Outcome::Numbers { first, last })
}

fn insert(call: u64, outcome: Outcome) -> Op {
    let tagged = call < 5;
    op(
        call * 10,
        call * 10 + 5,
        Call::Insert { call, tagged },
        outcome,
    )
}

fn take(invoke: u64, token: u8, outcome: Take) -> Op {
    let call = Call::Take {
        key: "seats".into(),
        token: oid(token),
    };
    op(invoke, invoke + 5, call, Outcome::Take(outcome))
}

fn give_back(invoke: u64, token: u8, outcome: GiveBack) -> Op {
    let call = Call::GiveBack {
        key: "seats".into(),
        token: oid(token),
    };
    op(invoke, invoke + 5, call, Outcome::GiveBack(outcome))
}

const COUNTED: Outcome = Outcome::Counted { earlier: false };
const COUNTED_EARLIER: Outcome = Outcome::Counted { earlier: true };

fn failed(maybe_applied: bool) -> Outcome {
    Outcome::Failed {
        error: "injected".into(),
        maybe_applied,
    }
}

/// A history with a bit of everything, all of it right.
struct Case {
    ops: Vec<Op>,
    end: FinalState,
    oracle: Oracle,
}

fn good() -> Case {
    let ops = vec![
        increment(0, 10, 2, 1, COUNTED),
        read(20, 30, 2),
        increment(25, 40, 3, 2, Outcome::Unknown),
        // Concurrent with the unknown increment: either value is right.
        read(30, 45, 5),
        resume(50, 60, 3, 2, COUNTED),
        resume(50, 62, 3, 2, COUNTED_EARLIER),
        op(
            70,
            71,
            Call::Crash {
                key: "k".into(),
                token: oid(3),
                amount: 1,
            },
            Outcome::Sent,
        ),
        read(80, 90, 6),
        increment(95, 99, 4, 4, Outcome::NotCounted),
        numbers(0, 5, 1, 1),
        numbers(10, 20, 3, 2),
        numbers(15, 25, 1, 5),
        insert(1, Outcome::Id(1)),
        insert(2, failed(true)),
        insert(3, failed(true)),
        insert(4, Outcome::Id(3)),
        // The same body as other untagged calls: told apart by its token.
        insert(5, Outcome::Id(4)),
        take(0, 5, Take::Taken),
        take(10, 5, Take::AlreadyTaken),
        take(20, 6, Take::Taken),
        give_back(30, 6, GiveBack::Returned),
        take(40, 7, Take::NoneLeft),
    ];
    let mut end = FinalState::default();
    end.counters.insert("k".into(), 6);
    end.sequences.insert("orders".into(), 5);
    end.inserted = vec![
        InsertedDoc {
            id: 1,
            call: Some(1),
            token: Some(oid(101)),
        },
        InsertedDoc {
            id: 2,
            call: Some(2),
            token: Some(oid(102)),
        },
        InsertedDoc {
            id: 3,
            call: Some(4),
            token: Some(oid(104)),
        },
        InsertedDoc {
            id: 4,
            call: None,
            token: Some(oid(105)),
        },
    ];
    end.bounded.insert(
        "seats".into(),
        BoundedState {
            initial: 2,
            available: 1,
            holders: vec![oid(5)],
        },
    );
    let mut oracle = Oracle::default();
    for (token, amount) in [(1, 2), (2, 3), (3, 1)] {
        oracle
            .step_1_reached
            .insert(oid(token), ("k".into(), amount));
    }
    for call in 1..=5 {
        let sent = InsertSent {
            call: (call < 5).then_some(call),
            reached: call != 3,
        };
        oracle.inserts.insert(oid(100 + call as u8), sent);
    }
    Case { ops, end, oracle }
}

impl Case {
    fn violations(&self) -> Vec<String> {
        check(&self.ops, &self.end, &self.oracle)
            .into_iter()
            .map(|v| v.what)
            .collect()
    }

    /// Asserts that some violation says `what`.
    fn caught(&self, what: &str) {
        let violations = self.violations();
        assert!(
            violations.iter().any(|v| v.contains(what)),
            "expected a violation saying {what:?}, got {violations:#?}"
        );
    }

    fn replace(&mut self, at: usize, op: Op) -> &mut Self {
        self.ops[at] = op;
        self
    }
}

#[test]
fn a_good_history_passes() {
    let case = good();
    assert_eq!(case.violations(), Vec::<String>::new());
}

#[test]
fn a_read_below_what_was_acknowledged_is_caught() {
    let mut case = good();
    case.replace(1, read(20, 30, 1));
    case.caught("read of k returned 1");
}

#[test]
fn a_read_above_what_was_invoked_is_caught() {
    let mut case = good();
    case.replace(0, increment(5, 10, 2, 1, COUNTED));
    case.ops.push(read(0, 3, 2));
    case.caught("read of k returned 2");
}

#[test]
fn a_read_that_goes_back_is_caught() {
    let mut case = good();
    case.replace(3, read(30, 35, 5));
    case.ops.push(read(36, 45, 2));
    case.caught("reads of k went back from 5 to 2");
}

#[test]
fn a_counter_off_the_counted_total_is_caught() {
    let mut case = good();
    case.end.counters.insert("k".into(), 9);
    case.caught("counter k ended at 9");
}

#[test]
fn a_token_counted_by_two_calls_is_caught() {
    let mut case = good();
    case.replace(5, resume(50, 62, 3, 2, COUNTED));
    case.caught("was counted by 2 calls");
}

#[test]
fn not_counted_while_step_1_reached_the_server_is_caught() {
    let mut case = good();
    case.replace(4, resume(50, 60, 3, 2, Outcome::NotCounted));
    case.replace(5, resume(50, 62, 3, 2, Outcome::Unknown));
    case.end.counters.insert("k".into(), 3);
    case.caught("ended not counted, but its step 1 reached the server");
}

#[test]
fn counted_without_a_step_1_on_the_server_is_caught() {
    let mut case = good();
    case.oracle.step_1_reached.remove(&oid(1));
    case.caught("no step 1 of it reached the server");
}

#[test]
fn not_counted_after_counted_is_caught() {
    let mut case = good();
    case.ops.push(resume(70, 80, 3, 2, Outcome::NotCounted));
    case.caught("said not counted after another call had said counted");
}

#[test]
fn a_concurrent_not_counted_beside_a_pending_settle_counts_it() {
    // One host's resume is refused its step 1 (nothing written) while
    // another's applies and leaves the token pending, for the fold.
    let mut case = good();
    case.replace(4, resume(50, 60, 3, 2, Outcome::NotCounted));
    case.replace(5, resume(50, 62, 3, 2, Outcome::Pending));
    assert_eq!(case.violations(), Vec::<String>::new());
    case.ops.push(resume(70, 80, 3, 2, Outcome::NotCounted));
    case.caught("said not counted after another call had said counted or pending");
}

#[test]
fn a_refused_resume_is_caught() {
    let mut case = good();
    case.ops
        .push(resume(70, 80, 3, 2, Outcome::Refused("horizon".into())));
    case.caught("refused");
}

#[test]
fn a_ticket_left_unsettled_is_caught() {
    let mut case = good();
    case.replace(4, resume(50, 60, 3, 2, Outcome::Unknown));
    case.replace(5, resume(50, 62, 3, 2, Outcome::Unknown));
    case.caught("left unsettled");
}

#[test]
fn a_step_1_no_call_made_is_caught() {
    let mut case = good();
    case.oracle.step_1_reached.insert(oid(9), ("k".into(), 1));
    case.caught("that no call made");
}

#[test]
fn a_sequence_number_handed_out_twice_is_caught() {
    let mut case = good();
    case.replace(10, numbers(10, 20, 3, 1));
    case.caught("number 1 handed out twice");
}

#[test]
fn a_sequence_number_above_the_final_value_is_caught() {
    let mut case = good();
    case.end.sequences.insert("orders".into(), 4);
    case.caught("5 handed out, but the sequence ended at Some(4)");
}

#[test]
fn a_sequence_going_back_in_real_time_is_caught() {
    let mut case = good();
    case.replace(9, numbers(0, 5, 1, 5));
    case.replace(11, numbers(15, 25, 1, 1));
    case.caught("handed out after 5 had been");
}

#[test]
fn an_id_handed_out_twice_is_caught() {
    let mut case = good();
    case.replace(15, insert(4, Outcome::Id(1)));
    case.caught("_id 1 handed out twice");
}

#[test]
fn an_id_holding_another_calls_document_is_caught() {
    let mut case = good();
    case.end.inserted[0].call = Some(2);
    case.caught("_id 1 was returned to call 1, but holds");
}

#[test]
fn an_id_holding_another_token_is_caught() {
    let mut case = good();
    case.end.inserted[0].token = Some(oid(102));
    case.caught("_id 1 was returned to call 1, but holds");
}

#[test]
fn one_id_for_two_callers_of_the_same_body_is_caught() {
    let mut case = good();
    case.ops.push(insert(6, Outcome::Id(4)));
    case.oracle.inserts.insert(
        oid(106),
        InsertSent {
            call: None,
            reached: true,
        },
    );
    case.caught("_id 4 handed out twice");
}

#[test]
fn one_calls_insert_stored_under_two_ids_is_caught() {
    let mut case = good();
    case.ops.push(insert(6, failed(true)));
    case.end.inserted.push(InsertedDoc {
        id: 5,
        call: None,
        token: Some(oid(105)),
    });
    case.caught("one call's token");
}

#[test]
fn a_document_no_insert_carried_is_caught() {
    let mut case = good();
    case.end.inserted[3].token = Some(oid(103));
    case.caught("is not one an insert carried");
}

#[test]
fn a_document_of_a_call_that_wrote_nothing_is_caught() {
    let mut case = good();
    case.replace(14, insert(3, failed(false)));
    case.end.inserted.push(InsertedDoc {
        id: 4,
        call: Some(3),
        token: Some(oid(103)),
    });
    case.caught("failed without writing");
}

#[test]
fn one_call_storing_two_documents_is_caught() {
    let mut case = good();
    case.end.inserted.push(InsertedDoc {
        id: 4,
        call: Some(1),
        token: Some(oid(101)),
    });
    case.caught("call 1 stored 2 documents");
}

#[test]
fn a_unit_held_twice_by_one_token_is_caught() {
    let mut case = good();
    case.end.bounded.get_mut("seats").unwrap().holders = vec![oid(5), oid(5)];
    case.end.bounded.get_mut("seats").unwrap().available = 0;
    case.caught("holds 2 units");
}

#[test]
fn stock_that_does_not_add_up_is_caught() {
    let mut case = good();
    case.end.bounded.get_mut("seats").unwrap().available = 0;
    case.caught("0 available + 1 held is not the 2 units");
}

#[test]
fn a_confirmed_unit_not_held_is_caught() {
    let mut case = good();
    let seats = case.end.bounded.get_mut("seats").unwrap();
    (seats.holders, seats.available) = (vec![], 2);
    case.caught("was confirmed a unit, but holds none");
}

#[test]
fn a_unit_given_back_but_still_held_is_caught() {
    let mut case = good();
    let seats = case.end.bounded.get_mut("seats").unwrap();
    (seats.holders, seats.available) = (vec![oid(5), oid(6)], 0);
    case.caught("holds a unit no take confirmed or may have taken");
}

#[test]
fn a_second_unit_for_one_token_is_caught() {
    let mut case = good();
    case.replace(18, take(10, 5, Take::Taken));
    case.caught("was given a second unit");
}

#[test]
fn a_unit_that_vanished_before_its_give_back_is_caught() {
    let mut case = good();
    case.replace(20, give_back(30, 6, GiveBack::NotHeld));
    case.caught("held a unit, but give_back found none");
}

#[test]
fn not_held_after_the_calls_own_lost_give_back_passes() {
    let mut case = good();
    case.replace(20, give_back(30, 6, GiveBack::NotHeld));
    case.oracle.given_back.insert(oid(6));
    assert_eq!(case.violations(), Vec::<String>::new());
}

#[test]
fn the_explanation_marks_the_calls_and_shows_their_neighbours() {
    let mut case = good();
    case.replace(1, read(20, 30, 1));
    let violations = check(&case.ops, &case.end, &case.oracle);
    let text = explain(&case.ops, &violations[0], 30);
    assert!(text.contains("» #1 "), "{text}");
    // The increment acknowledged before the read is shown beside it.
    assert!(text.contains("increment(k, +3)"), "{text}");
}

fn add(amount: i64, position: i64, outcome: Outcome) -> Op {
    let call = Call::Add {
        key: "l".into(),
        amount,
        lane: oid(7).to_hex(),
        position,
    };
    op(0, 10, call, outcome)
}

fn lane_oracle(updates: &[(i64, i64)]) -> Oracle {
    Oracle {
        lane_updates: updates
            .iter()
            .map(|(position, amount)| ((oid(7).to_hex(), *position), ("l".to_owned(), *amount)))
            .collect(),
        ..Oracle::default()
    }
}

/// A group of three callers in one update, a second update unknown and
/// resumed: passes. A caller told counted whose update never reached the
/// server, an update whose sum is not its callers' shares, a counter off
/// by one, an unknown never settled: each caught.
#[test]
fn lane_groups_are_judged_caller_by_caller_against_the_log() {
    let counted = || Outcome::Counted { earlier: false };
    let resume = Op {
        call: Call::ResumeLane {
            key: "l".into(),
            lane: oid(7).to_hex(),
            position: 2,
            total: 5,
        },
        ..add(5, 2, Outcome::Counted { earlier: true })
    };
    let good = vec![
        add(1, 1, counted()),
        add(2, 1, counted()),
        add(3, 1, counted()),
        add(5, 2, Outcome::Unknown),
        resume.clone(),
    ];
    let end = FinalState {
        lane_counters: [("l".to_owned(), 11)].into(),
        ..FinalState::default()
    };
    let oracle = lane_oracle(&[(1, 6), (2, 5)]);
    assert!(check(&good, &end, &oracle).is_empty());

    let lost = lane_oracle(&[(2, 5)]);
    let found = check(&good, &end, &lost);
    assert!(
        found.iter().any(|v| v.what.contains("never reached")),
        "{found:?}"
    );
    let short = lane_oracle(&[(1, 5), (2, 5)]);
    let found = check(&good, &end, &short);
    assert!(
        found.iter().any(|v| v.what.contains("shares sum to 6")),
        "{found:?}"
    );
    let off = FinalState {
        lane_counters: [("l".to_owned(), 12)].into(),
        ..FinalState::default()
    };
    assert!(!check(&good, &off, &oracle).is_empty());
    let unsettled = &good[..4];
    let found = check(unsettled, &end, &oracle);
    assert!(
        found.iter().any(|v| v.what.contains("never settled")),
        "{found:?}"
    );
}
