//! tally's integration tests: the real library and the real `tallyd` binary
//! against a real server on loopback (SecantusDB, started by the tests), or
//! against the server named by `TALLY_TEST_MONGODB_URI`.

mod api;
mod bounded;
mod buckets;
mod cli;
mod closing;
mod common;
mod daemon;
mod daemon_life;
mod doctor;
mod envfile;
mod errors;
mod faults;
mod faults_group;
mod history;
mod increment;
mod insert_loop;
mod lanes;
mod layout;
mod ledger;
mod messages;
mod overflow;
mod packaging;
mod proxy;
mod pruning;
mod ranges;
mod reconcile;
mod sequence;
mod settle;
mod setup;
mod sharding;
mod shown_book;
mod shown_commands;
mod shown_configs;
mod soak;
mod soak_buckets;
mod soak_group;
mod soak_lanes;
mod stop;
mod streaming;
mod tickets;
