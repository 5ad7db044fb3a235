//! Server error codes tally names, as the server defines them, and the
//! sets of them that decide a failure's class.

/// `HostUnreachable`.
pub(crate) const HOST_UNREACHABLE: i32 = 6;
/// `HostNotFound`.
pub(crate) const HOST_NOT_FOUND: i32 = 7;
/// `NetworkTimeout`.
pub(crate) const NETWORK_TIMEOUT: i32 = 89;
/// `ShutdownInProgress`.
pub(crate) const SHUTDOWN_IN_PROGRESS: i32 = 91;
/// `PrimarySteppedDown`.
pub(crate) const PRIMARY_STEPPED_DOWN: i32 = 189;
/// `ExceededTimeLimit`.
pub(crate) const EXCEEDED_TIME_LIMIT: i32 = 262;
/// `SocketException`.
pub(crate) const SOCKET_EXCEPTION: i32 = 9001;
/// `NotWritablePrimary` (formerly `NotMaster`).
pub(crate) const NOT_WRITABLE_PRIMARY: i32 = 10107;
/// `InterruptedAtShutdown`.
pub(crate) const INTERRUPTED_AT_SHUTDOWN: i32 = 11600;
/// `InterruptedDueToReplStateChange`.
pub(crate) const INTERRUPTED_DUE_TO_REPL_STATE_CHANGE: i32 = 11602;
/// `NotPrimaryNoSecondaryOk`.
pub(crate) const NOT_PRIMARY_NO_SECONDARY_OK: i32 = 13435;
/// `NotPrimaryOrSecondary`.
pub(crate) const NOT_PRIMARY_OR_SECONDARY: i32 = 13436;
/// `DuplicateKey`.
pub(crate) const DUPLICATE_KEY: i32 = 11000;
/// `DuplicateKey` as reported by old servers for updates.
pub(crate) const DUPLICATE_KEY_ON_UPDATE: i32 = 11001;
/// `DuplicateKeyValue` (a duplicate found while building an index).
pub(crate) const DUPLICATE_KEY_VALUE: i32 = 12582;
/// `CursorNotFound`: the server no longer has a cursor (killed, timed
/// out, or on a node that stepped down). A read sent again starts anew.
pub(crate) const CURSOR_NOT_FOUND: i32 = 43;
/// `ReadConcernMajorityNotAvailableYet`: a node that just started or
/// stepped up cannot serve a majority read yet.
pub(crate) const READ_CONCERN_MAJORITY_NOT_AVAILABLE_YET: i32 = 134;
/// `ChangeStreamHistoryLost`: a resume token fell off the oplog (the
/// daemon's change-stream monitor).
#[cfg(feature = "daemon")]
pub(crate) const CHANGE_STREAM_HISTORY_LOST: i32 = 286;
/// `ChangeStreamFatalError`: the stream cannot go on from where it is
/// (the daemon's monitor starts a new one).
#[cfg(feature = "daemon")]
pub(crate) const CHANGE_STREAM_FATAL_ERROR: i32 = 280;
/// `InvalidResumeToken`: the server cannot resume from the saved token
/// (the daemon's monitor starts a new stream).
#[cfg(feature = "daemon")]
pub(crate) const INVALID_RESUME_TOKEN: i32 = 260;

/// Codes that make a failed attempt transient: the node is not (or no
/// longer) a writable primary, is recovering or shutting down, or the
/// network failed on the server's side.
pub(crate) const TRANSIENT: [i32; 12] = [
    HOST_UNREACHABLE,
    HOST_NOT_FOUND,
    NETWORK_TIMEOUT,
    SHUTDOWN_IN_PROGRESS,
    PRIMARY_STEPPED_DOWN,
    EXCEEDED_TIME_LIMIT,
    SOCKET_EXCEPTION,
    NOT_WRITABLE_PRIMARY,
    INTERRUPTED_AT_SHUTDOWN,
    INTERRUPTED_DUE_TO_REPL_STATE_CHANGE,
    NOT_PRIMARY_NO_SECONDARY_OK,
    NOT_PRIMARY_OR_SECONDARY,
];

/// Codes that make a failed *read* transient besides [`TRANSIENT`]: the
/// read changed nothing, and sent again it may well succeed. A write
/// never sees them.
pub(crate) const READ_TRANSIENT: [i32; 2] =
    [CURSOR_NOT_FOUND, READ_CONCERN_MAJORITY_NOT_AVAILABLE_YET];

/// Codes that mean "a document with this unique key already exists".
pub(crate) const DUPLICATE_KEY_CODES: [i32; 3] =
    [DUPLICATE_KEY, DUPLICATE_KEY_ON_UPDATE, DUPLICATE_KEY_VALUE];
