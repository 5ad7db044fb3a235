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
/// ledger's log, the daemon's change-stream monitor).
pub(crate) const CHANGE_STREAM_HISTORY_LOST: i32 = 286;
/// `CappedPositionLost`: an open change stream's place in the oplog was
/// overwritten before it read it.
pub(crate) const CAPPED_POSITION_LOST: i32 = 136;
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

/// `BadValue`: the server refused a value (an `$inc` past the int64
/// limit among others).
pub(crate) const BAD_VALUE: i32 = 2;
/// `Unauthorized`: the connected user lacks the privilege.
pub(crate) const UNAUTHORIZED: i32 = 13;
/// `TypeMismatch`: a field holds another type than the update needs.
pub(crate) const TYPE_MISMATCH: i32 = 14;
/// `AuthenticationFailed`: the server refused the credentials.
pub(crate) const AUTHENTICATION_FAILED: i32 = 18;
/// `NamespaceNotFound`: the collection (or database) does not exist.
pub(crate) const NAMESPACE_NOT_FOUND: i32 = 26;
/// `DocumentValidationFailure`: the collection's validator refused the
/// document.
pub(crate) const DOCUMENT_VALIDATION_FAILURE: i32 = 121;
/// `BSONObjectTooLarge`: the document would exceed the server's 16 MB.
pub(crate) const BSON_OBJECT_TOO_LARGE: i32 = 10334;
/// The update's result would exceed 16 MB (older servers' code).
pub(crate) const UPDATE_RESULT_TOO_LARGE: i32 = 17419;
/// The document to upsert would exceed 16 MB (older servers' code).
pub(crate) const UPSERT_TOO_LARGE: i32 = 17420;

/// The code name the server gives `code`, for the codes tally's messages
/// meet: write errors arrive without one, and a message shows both.
pub(crate) fn name(code: i32) -> Option<&'static str> {
    Some(match code {
        1 => "InternalError",
        BAD_VALUE => "BadValue",
        4 => "NoSuchKey",
        HOST_UNREACHABLE => "HostUnreachable",
        HOST_NOT_FOUND => "HostNotFound",
        8 => "UnknownError",
        9 => "FailedToParse",
        11 => "UserNotFound",
        UNAUTHORIZED => "Unauthorized",
        TYPE_MISMATCH => "TypeMismatch",
        AUTHENTICATION_FAILED => "AuthenticationFailed",
        20 => "IllegalOperation",
        NAMESPACE_NOT_FOUND => "NamespaceNotFound",
        CURSOR_NOT_FOUND => "CursorNotFound",
        50 => "MaxTimeMSExpired",
        59 => "CommandNotFound",
        64 => "WriteConcernFailed",
        66 => "ImmutableField",
        67 => "CannotCreateIndex",
        68 => "IndexAlreadyExists",
        85 => "IndexOptionsConflict",
        86 => "IndexKeySpecsConflict",
        NETWORK_TIMEOUT => "NetworkTimeout",
        SHUTDOWN_IN_PROGRESS => "ShutdownInProgress",
        100 => "UnsatisfiableWriteConcern",
        DOCUMENT_VALIDATION_FAILURE => "DocumentValidationFailure",
        READ_CONCERN_MAJORITY_NOT_AVAILABLE_YET => "ReadConcernMajorityNotAvailableYet",
        PRIMARY_STEPPED_DOWN => "PrimarySteppedDown",
        260 => "InvalidResumeToken",
        EXCEEDED_TIME_LIMIT => "ExceededTimeLimit",
        280 => "ChangeStreamFatalError",
        286 => "ChangeStreamHistoryLost",
        SOCKET_EXCEPTION => "SocketException",
        NOT_WRITABLE_PRIMARY => "NotWritablePrimary",
        BSON_OBJECT_TOO_LARGE => "BSONObjectTooLarge",
        DUPLICATE_KEY | DUPLICATE_KEY_ON_UPDATE => "DuplicateKey",
        INTERRUPTED_AT_SHUTDOWN => "InterruptedAtShutdown",
        INTERRUPTED_DUE_TO_REPL_STATE_CHANGE => "InterruptedDueToReplStateChange",
        DUPLICATE_KEY_VALUE => "DuplicateKeyValue",
        NOT_PRIMARY_NO_SECONDARY_OK => "NotPrimaryNoSecondaryOk",
        NOT_PRIMARY_OR_SECONDARY => "NotPrimaryOrSecondary",
        _ => return None,
    })
}
