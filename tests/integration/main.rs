//! tally's integration tests: the real library and the real `tallyd` binary
//! against a real server on loopback (SecantusDB, started by the tests), or
//! against the server named by `TALLY_TEST_MONGODB_URI`.

mod bounded;
mod cli;
mod common;
mod daemon;
mod doctor;
mod faults;
mod faults_ledger;
mod history;
mod increment;
mod insert_loop;
mod lanes;
mod layout;
mod ledger;
mod ledger_daemon;
mod ledger_findings;
mod ledger_prune;
mod ledger_review;
mod ledger_review2;
mod ledger_soak;
mod packaging;
mod proxy;
mod pruning;
mod reconcile;
mod sequence;
mod settle;
mod soak;
mod soak_lanes;
