//! A fault-injecting TCP proxy ("black pipe") between the driver and the
//! server, aware of MongoDB wire framing, so a test can say "drop the reply to
//! the 3rd `update` on `views`" and then count exactly what reached the server.
//!
//! Every client connection gets its own upstream connection and two pumps:
//! requests (client to server) and replies (server to client). Each runs
//! independently, so the driver's streaming monitor (one request, several
//! `moreToCome` replies) keeps working. Replies are matched to requests by
//! `responseTo == requestID`.
//!
//! A held request ([`Action::HoldRequest`]) is a request delayed in the
//! network: the client's attempt fails at once (its connection closes), the
//! client's later attempts go through, and the held request reaches the
//! server only afterwards — on the upstream connection it would have used,
//! when the test calls [`Proxy::release_held`] or after later requests got
//! their replies ([`Release`]).
//!
//! Rules ([`Rule`]) apply only to `OP_MSG` requests that expect a reply; every
//! other message (`OP_QUERY`, `OP_COMPRESSED`, `moreToCome` requests, replies
//! nobody waits for) passes through untouched. The [`Exchange`] log records
//! every client request and what happened to it: it is the ground truth a
//! test computes exact expected counts from.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use mongodb::Client;
use mongodb::bson::{Bson, Document, doc};
use mongodb::options::{ClientOptions, Tls};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// `OP_MSG`: the opcode of every command and reply the driver sends today.
pub const OP_MSG: i32 = 2013;
/// `OP_QUERY`: the legacy opcode, only parsed to name the command in the log.
pub const OP_QUERY: i32 = 2004;

/// `OP_MSG` flag bit: a CRC-32C checksum follows the sections.
const CHECKSUM_PRESENT: u32 = 1;
/// `OP_MSG` flag bit: the sender will send another message without waiting.
const MORE_TO_COME: u32 = 1 << 1;
/// Larger than the server's 48 MB limit; anything bigger is not a message.
const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;
const HEADER_BYTES: usize = 16;
/// How long [`Proxy::release_held`] waits for the server's replies.
const HELD_PATIENCE: Duration = Duration::from_secs(30);

/// Why a byte buffer could not be understood as a wire message.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The buffer ends before its header or one of its parts says it does.
    #[error("the message is truncated or its lengths are inconsistent")]
    Truncated,
    /// An `OP_MSG` section kind other than 0 (body) or 1 (document sequence).
    #[error("unknown OP_MSG section kind {0}")]
    UnknownSection(u8),
    /// An `OP_MSG` must carry exactly one kind-0 body section.
    #[error("the OP_MSG has {0} body sections instead of one")]
    BodyCount(usize),
    /// A C string (collection name, sequence identifier) is not UTF-8 or not
    /// terminated.
    #[error("a C string in the message is unterminated or not UTF-8")]
    BadCString,
    /// A document is not valid BSON.
    #[error("invalid BSON: {0}")]
    Bson(#[from] mongodb::bson::error::Error),
}

/// One wire message as the proxy understood it: enough to name the command
/// for rules and the log.
#[derive(Debug, Clone)]
pub struct WireMessage {
    /// The sender's id for this message.
    pub request_id: i32,
    /// The `request_id` this message answers (0 for requests).
    pub response_to: i32,
    /// The wire opcode (`OP_MSG`, `OP_QUERY`, ...).
    pub opcode: i32,
    /// `OP_MSG` flag bits (checksum, `moreToCome`, `exhaustAllowed`); 0 for
    /// other opcodes.
    pub flag_bits: u32,
    /// The command name: the body's first key.
    pub command: Option<String>,
    /// The collection: the value of the first key when it is a string
    /// (for a `getMore`, its `collection`).
    pub collection: Option<String>,
    /// The command body with every kind-1 document sequence merged in under
    /// its identifier (`documents`, `updates`, ...); empty for opcodes the
    /// proxy does not parse.
    pub body: Document,
}

impl WireMessage {
    /// Parses a whole message (header included). `OP_MSG` and `OP_QUERY`
    /// bodies are decoded; other opcodes yield just the header.
    pub fn parse(bytes: &[u8]) -> Result<Self, FrameError> {
        if bytes.len() < HEADER_BYTES || read_i32(bytes, 0)? as usize != bytes.len() {
            return Err(FrameError::Truncated);
        }
        let mut message = Self {
            request_id: read_i32(bytes, 4)?,
            response_to: read_i32(bytes, 8)?,
            opcode: read_i32(bytes, 12)?,
            flag_bits: 0,
            command: None,
            collection: None,
            body: Document::new(),
        };
        match message.opcode {
            OP_MSG => {
                let flag_bits = read_i32(bytes, HEADER_BYTES)? as u32;
                message.flag_bits = flag_bits;
                message.body = parse_op_msg_sections(bytes, flag_bits)?;
            }
            OP_QUERY => message.body = parse_op_query(bytes)?,
            _ => return Ok(message),
        }
        if let Some((name, value)) = message.body.iter().next() {
            message.command = Some(name.clone());
            message.collection = value.as_str().map(str::to_owned);
        }
        // A `getMore` names its cursor first, and its collection in
        // `collection`: a rule can select the reads of one collection's
        // cursors (a change stream's, a `find`'s).
        if message.command.as_deref() == Some("getMore") {
            message.collection = message.body.get_str("collection").ok().map(str::to_owned);
        }
        Ok(message)
    }

    /// Just the header (and `OP_MSG` flag bits) of a message at least a
    /// header long: for replies, which need no decoding, and for requests
    /// that do not parse (they are still forwarded and logged).
    fn header_only(bytes: &[u8]) -> Self {
        let field = |at| read_i32(bytes, at).unwrap_or_default();
        let opcode = field(12);
        Self {
            request_id: field(4),
            response_to: field(8),
            opcode,
            flag_bits: if opcode == OP_MSG {
                field(HEADER_BYTES) as u32
            } else {
                0
            },
            command: None,
            collection: None,
            body: Document::new(),
        }
    }

    /// Whether the sender waits for a reply: every `OP_QUERY`, and every
    /// `OP_MSG` without `moreToCome` (unacknowledged writes set it).
    pub fn expects_reply(&self) -> bool {
        match self.opcode {
            OP_MSG => self.flag_bits & MORE_TO_COME == 0,
            OP_QUERY => true,
            _ => false,
        }
    }

    /// Whether this reply is followed by more replies to the same request
    /// (the streaming monitor's exhaust mode).
    fn more_to_come(&self) -> bool {
        self.opcode == OP_MSG && self.flag_bits & MORE_TO_COME != 0
    }
}

/// Encodes an `OP_MSG` with flag bits 0 and a single body section: how the
/// proxy answers for the server.
pub fn encode_op_msg(request_id: i32, response_to: i32, body: &Document) -> Vec<u8> {
    encode_op_msg_with_flags(request_id, response_to, 0, body)
}

/// The same with these flag bits (`moreToCome` kept for a reply of an
/// exhaust stream; a checksum is never written, so its bit is cleared).
fn encode_op_msg_with_flags(
    request_id: i32,
    response_to: i32,
    flag_bits: u32,
    body: &Document,
) -> Vec<u8> {
    let body = body
        .to_vec()
        .expect("a Document always encodes (keys have no NUL bytes)");
    let length = HEADER_BYTES + 4 + 1 + body.len();
    let mut bytes = Vec::with_capacity(length);
    bytes.extend_from_slice(&(length as i32).to_le_bytes());
    bytes.extend_from_slice(&request_id.to_le_bytes());
    bytes.extend_from_slice(&response_to.to_le_bytes());
    bytes.extend_from_slice(&OP_MSG.to_le_bytes());
    bytes.extend_from_slice(&(flag_bits & !CHECKSUM_PRESENT).to_le_bytes());
    bytes.push(0);
    bytes.extend_from_slice(&body);
    bytes
}

fn read_i32(bytes: &[u8], at: usize) -> Result<i32, FrameError> {
    let field = bytes.get(at..at + 4).ok_or(FrameError::Truncated)?;
    Ok(i32::from_le_bytes(
        field.try_into().map_err(|_| FrameError::Truncated)?,
    ))
}

/// Reads a NUL-terminated string at `at` in `bytes[..end]`; returns it and the
/// offset just past the NUL.
fn read_cstring(bytes: &[u8], at: usize, end: usize) -> Result<(String, usize), FrameError> {
    let region = bytes.get(at..end).ok_or(FrameError::Truncated)?;
    let nul = region
        .iter()
        .position(|&b| b == 0)
        .ok_or(FrameError::BadCString)?;
    let text = std::str::from_utf8(&region[..nul]).map_err(|_| FrameError::BadCString)?;
    Ok((text.to_owned(), at + nul + 1))
}

/// Reads the BSON document at `at` in `bytes[..end]`; returns it and the
/// offset just past it.
fn read_document(bytes: &[u8], at: usize, end: usize) -> Result<(Document, usize), FrameError> {
    let length = usize::try_from(read_i32(bytes, at)?).map_err(|_| FrameError::Truncated)?;
    let next = at.checked_add(length).ok_or(FrameError::Truncated)?;
    if next > end {
        return Err(FrameError::Truncated);
    }
    Ok((Document::from_reader(&bytes[at..next])?, next))
}

fn parse_op_msg_sections(bytes: &[u8], flag_bits: u32) -> Result<Document, FrameError> {
    let end = if flag_bits & CHECKSUM_PRESENT != 0 {
        bytes.len().checked_sub(4).ok_or(FrameError::Truncated)?
    } else {
        bytes.len()
    };
    let mut body = None;
    let mut sequences = Vec::new();
    let mut at = HEADER_BYTES + 4;
    while at < end {
        let kind = bytes[at];
        at += 1;
        match kind {
            0 => {
                let (document, next) = read_document(bytes, at, end)?;
                if body.replace(document).is_some() {
                    return Err(FrameError::BodyCount(2));
                }
                at = next;
            }
            1 => {
                let size =
                    usize::try_from(read_i32(bytes, at)?).map_err(|_| FrameError::Truncated)?;
                let section_end = at.checked_add(size).ok_or(FrameError::Truncated)?;
                if size < 4 || section_end > end {
                    return Err(FrameError::Truncated);
                }
                let (identifier, mut next) = read_cstring(bytes, at + 4, section_end)?;
                let mut documents = Vec::new();
                while next < section_end {
                    let (document, after) = read_document(bytes, next, section_end)?;
                    documents.push(Bson::Document(document));
                    next = after;
                }
                sequences.push((identifier, documents));
                at = section_end;
            }
            other => return Err(FrameError::UnknownSection(other)),
        }
    }
    let mut body = body.ok_or(FrameError::BodyCount(0))?;
    for (identifier, documents) in sequences {
        match body.get_mut(&identifier) {
            Some(Bson::Array(existing)) => existing.extend(documents),
            _ => {
                body.insert(identifier, documents);
            }
        }
    }
    Ok(body)
}

/// `OP_QUERY`: flags, full collection name, skip, limit, then the query.
fn parse_op_query(bytes: &[u8]) -> Result<Document, FrameError> {
    let (_namespace, at) = read_cstring(bytes, HEADER_BYTES + 4, bytes.len())?;
    let (query, _) = read_document(bytes, at + 8, bytes.len())?;
    // Legacy drivers wrap a command with read preference as `{$query: {...}}`.
    match query.get("$query") {
        Some(Bson::Document(inner)) => Ok(inner.clone()),
        _ => Ok(query),
    }
}

/// What the proxy does to a request a [`Rule`] selected.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Forward the request; when the server's reply arrives, discard it and
    /// close both connections. The server executed the command; the client
    /// sees a network error.
    DropReply,
    /// Close the client connection without forwarding: the server never sees
    /// the command.
    CloseBeforeForwarding,
    /// Forward, then hold the reply this long before delivering it (not at
    /// all if the client has gone by then).
    DelayReply(Duration),
    /// Never forward; answer with the duplicate-key error on `_id` the
    /// server would send for this command: a write error (`ok: 1`,
    /// `writeErrors`) for `insert` and `update`, a command error (`ok: 0`)
    /// otherwise (`findAndModify`), with `keyPattern` and `keyValue` as
    /// MongoDB 4.4+ reports them.
    DuplicateKey,
    /// Forward; when the server's reply arrives, add a `writeConcernError`
    /// with this code (and labels, at the top of the reply, where the
    /// server puts them) before delivering it: the server executed the
    /// write, its replication is unconfirmed.
    WriteConcernError {
        /// The server error code, e.g. 64 (`WriteConcernFailed`).
        code: i32,
        /// The code's name.
        code_name: String,
        /// Error labels, e.g. `RetryableWriteError`; omitted when empty.
        labels: Vec<String>,
    },
    /// Hold the request without forwarding it and close the client's
    /// connection (the client sees a network error; its driver may retry on
    /// another connection). The held request is forwarded on its own
    /// upstream connection once `Release` says so, and the server's reply is
    /// recorded (never delivered: the client has gone). Dropping the proxy
    /// first discards it: it never reaches the server.
    HoldRequest(Release),
    /// Never forward; answer with this document (`ok: 1` added when it
    /// has no `ok`): a server that is not there, e.g. a mongos's
    /// `listShards` in front of a replica set.
    Answer(Document),
    /// Forward; when the server's replies arrive (every reply of an exhaust
    /// stream), set these fields in them before delivering: the server's
    /// answer, partly someone else's (e.g. `hello` with `msg: "isdbgrid"`,
    /// as a mongos says it).
    AmendReply(Document),
    /// Never forward; answer as the server would with this error.
    Error {
        /// The server error code, e.g. 10107.
        code: i32,
        /// The code's name, e.g. `NotWritablePrimary`.
        code_name: String,
        /// Error labels, e.g. `RetryableWriteError`; omitted when empty.
        labels: Vec<String>,
    },
}

/// When a held request ([`Action::HoldRequest`]) is forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// When the test calls [`Proxy::release_held`].
    WhenReleased,
    /// Once this many later requests with the same command on the same
    /// collection got their replies (e.g. 1: after the client's retry
    /// completed), or when the test releases it, whichever comes first.
    AfterLaterReplies(usize),
}

impl Action {
    /// Shorthand for [`Action::Error`].
    pub fn error(code: i32, code_name: &str, labels: &[&str]) -> Self {
        Self::Error {
            code,
            code_name: code_name.to_owned(),
            labels: labels.iter().map(|l| (*l).to_owned()).collect(),
        }
    }
}

impl Action {
    /// Shorthand for [`Action::WriteConcernError`].
    pub fn write_concern_error(code: i32, code_name: &str, labels: &[&str]) -> Self {
        Self::WriteConcernError {
            code,
            code_name: code_name.to_owned(),
            labels: labels.iter().map(|l| (*l).to_owned()).collect(),
        }
    }
}

/// `reply` (the server's, parsed) with a write-concern error added, as the
/// server would send it.
fn with_write_concern_error(
    reply: &WireMessage,
    code: i32,
    code_name: &str,
    labels: &[String],
) -> Vec<u8> {
    let mut body = reply.body.clone();
    body.insert(
        "writeConcernError",
        doc! {
            "code": code,
            "codeName": code_name,
            "errmsg": format!("{code_name} ({code}) injected by test proxy"),
        },
    );
    if !labels.is_empty() {
        body.insert("errorLabels", labels);
    }
    encode_op_msg(reply.request_id, reply.response_to, &body)
}

/// `reply` (the server's, parsed) with `fields` set, its flag bits kept.
fn amended(reply: &WireMessage, fields: &Document) -> Vec<u8> {
    let mut body = reply.body.clone();
    for (key, value) in fields {
        body.insert(key.clone(), value.clone());
    }
    encode_op_msg_with_flags(reply.request_id, reply.response_to, reply.flag_bits, &body)
}

/// The reply for an [`Action::Answer`]: `body`, with `ok: 1` unless it
/// says otherwise.
fn answer_reply(body: &Document, request_id: i32, response_to: i32) -> Vec<u8> {
    let mut body = body.clone();
    if !body.contains_key("ok") {
        body.insert("ok", 1.0);
    }
    encode_op_msg(request_id, response_to, &body)
}

/// The reply the server would send for an [`Action::Error`].
fn error_reply(
    code: i32,
    code_name: &str,
    labels: &[String],
    request_id: i32,
    response_to: i32,
) -> Vec<u8> {
    let mut body = doc! {
        "ok": 0.0,
        "errmsg": format!("{code_name} ({code}) injected by test proxy"),
        "code": code,
        "codeName": code_name,
    };
    if !labels.is_empty() {
        body.insert("errorLabels", labels);
    }
    encode_op_msg(request_id, response_to, &body)
}

/// The reply the server would send for an [`Action::DuplicateKey`] on
/// `request`.
fn duplicate_key_reply(request: &WireMessage, reply_id: i32) -> Vec<u8> {
    let first = |array: &str, field: &str| {
        request
            .body
            .get_array(array)
            .ok()
            .and_then(|items| items.first())
            .and_then(Bson::as_document)
            .and_then(|item| match field {
                "" => Some(item),
                _ => item.get_document(field).ok(),
            })
            .and_then(|d| d.get("_id").cloned())
    };
    let id = match request.command.as_deref() {
        Some("insert") => first("documents", ""),
        Some("update") => first("updates", "q"),
        _ => request
            .body
            .get_document("query")
            .ok()
            .and_then(|q| q.get("_id").cloned()),
    }
    .unwrap_or(Bson::Null);
    let error = doc! {
        "code": 11000,
        "codeName": "DuplicateKey",
        "errmsg": format!("E11000 duplicate key error (injected by test proxy) dup key: {{ _id: {id} }}"),
        "keyPattern": { "_id": 1 },
        "keyValue": { "_id": id },
    };
    let body = match request.command.as_deref() {
        Some("insert" | "update") => {
            let mut error = error;
            error.insert("index", 0);
            let mut body = doc! { "n": 0, "writeErrors": [error], "ok": 1.0 };
            if request.command.as_deref() == Some("update") {
                body.insert("nModified", 0);
            }
            body
        }
        _ => {
            let mut body = error;
            body.insert("ok", 0.0);
            body
        }
    };
    encode_op_msg(reply_id, request.request_id, &body)
}

/// Which requests a rule selects; every criterion is optional and all must
/// hold. Build one with [`Rule::command`] or [`Rule::any`], finish it with
/// [`Matcher::then`].
#[derive(Debug, Clone, Default)]
pub struct Matcher {
    command: Option<String>,
    collection: Option<String>,
    database: Option<String>,
    mentions: Option<String>,
    nth: Option<u64>,
    after: Option<u64>,
    probability: Option<(f64, u64)>,
}

impl Matcher {
    /// Only requests on this collection (the value of the command's first
    /// key).
    pub fn collection(mut self, name: &str) -> Self {
        self.collection = Some(name.to_owned());
        self
    }

    /// Only requests on this database (the command's `$db`), e.g. `config`
    /// for a `find` on `config.collections`.
    pub fn database(mut self, name: &str) -> Self {
        self.database = Some(name.to_owned());
        self
    }

    /// Only requests whose body names `key` as a field anywhere (e.g.
    /// `$changeStream` in an `aggregate`'s pipeline).
    pub fn mentions(mut self, key: &str) -> Self {
        self.mentions = Some(key.to_owned());
        self
    }

    /// Only the `n`th request (1-based) that meets every other criterion,
    /// probability included; counted per rule.
    pub fn nth(mut self, n: u64) -> Self {
        assert!(n >= 1, "nth is 1-based");
        self.nth = Some(n);
        self
    }

    /// Every request after the first `n` that meet every other criterion
    /// (a fault that starts part-way and persists: a crash).
    pub fn after(mut self, n: u64) -> Self {
        self.after = Some(n);
        self
    }

    /// Each request meeting the command and collection criteria is selected
    /// with probability `p`, drawn from a generator seeded with `seed`: the
    /// same seed and the same requests select the same ones.
    pub fn probability(mut self, p: f64, seed: u64) -> Self {
        assert!((0.0..=1.0).contains(&p), "probability {p} is not in [0, 1]");
        self.probability = Some((p, seed));
        self
    }

    /// The rule: do `action` to every request this matcher selects.
    pub fn then(self, action: Action) -> Rule {
        Rule {
            matcher: self,
            action,
        }
    }
}

/// A matcher plus an action, installed with [`Proxy::rule`].
#[derive(Debug, Clone)]
pub struct Rule {
    matcher: Matcher,
    action: Action,
}

impl Rule {
    /// A matcher for requests whose command name is `name` (`update`,
    /// `insert`, `findAndModify`, ...).
    pub fn command(name: &str) -> Matcher {
        Matcher {
            command: Some(name.to_owned()),
            ..Matcher::default()
        }
    }

    /// A matcher for every request that expects a reply, monitoring `hello`s
    /// included.
    pub fn any() -> Matcher {
        Matcher::default()
    }
}

/// An installed rule and its per-rule state.
struct ActiveRule {
    id: u64,
    rule: Rule,
    /// Requests that met every criterion but `nth` so far.
    selected: u64,
    random: Option<(f64, fastrand::Rng)>,
}

impl ActiveRule {
    /// Whether the rule selects `message`. Advances the rule's counter and
    /// generator, so it is called once per request for every rule.
    fn selects(&mut self, message: &WireMessage) -> bool {
        let matcher = &self.rule.matcher;
        if matcher
            .command
            .as_ref()
            .is_some_and(|c| message.command.as_ref() != Some(c))
            || matcher
                .collection
                .as_ref()
                .is_some_and(|c| message.collection.as_ref() != Some(c))
            || matcher
                .database
                .as_ref()
                .is_some_and(|d| message.body.get_str("$db").ok() != Some(d.as_str()))
            || matcher
                .mentions
                .as_ref()
                .is_some_and(|key| !document_mentions(&message.body, key))
        {
            return false;
        }
        if let Some((p, random)) = &mut self.random
            && random.f64() >= *p
        {
            return false;
        }
        self.selected += 1;
        matcher.nth.is_none_or(|n| n == self.selected)
            && matcher.after.is_none_or(|n| self.selected > n)
    }
}

/// Removes its rule from the proxy when dropped (also when the test panics).
#[must_use = "the rule is removed as soon as the guard is dropped"]
pub struct RuleGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for RuleGuard {
    fn drop(&mut self) {
        lock(&self.shared.rules).retain(|rule| rule.id != self.id);
    }
}

/// What happened to one client request: the ground truth of what reached the
/// server and what the client saw.
#[derive(Debug, Clone)]
pub struct Exchange {
    /// Which client connection sent it (numbered from 1 in accept order).
    pub connection: u64,
    /// The request's `requestID`.
    pub request_id: i32,
    /// The request's opcode.
    pub opcode: i32,
    /// The command name, when the message could be parsed.
    pub command: Option<String>,
    /// The collection, when the command's first value is a string (for a
    /// `getMore`, its `collection`).
    pub collection: Option<String>,
    /// The command with its document sequences merged in (see
    /// [`WireMessage::body`]).
    pub body: Document,
    /// Whether the client waits for a reply (no rule applies otherwise).
    pub expects_reply: bool,
    /// The action of the rule that selected it, if any.
    pub action: Option<Action>,
    /// The request was written to the server.
    pub reached_server: bool,
    /// Its place in the order in which the proxy began writing requests to
    /// the server (0 first, across connections): a held request forwarded
    /// late comes after the requests sent meanwhile, though it arrived
    /// first. `None` while not forwarded.
    pub forwarded: Option<u64>,
    /// A reply from the server came back for it.
    pub server_replied: bool,
    /// How many replies the server sent for it: more than one only for an
    /// exhaust stream (the monitor's awaitable `hello`).
    pub server_replies: u32,
    /// The body of the server's (first) reply, whether or not it was
    /// delivered: what the server did, e.g. an `update`'s `n` and
    /// `nModified`.
    pub reply: Option<Document>,
    /// A reply (the server's, or an injected error) was written to the
    /// client.
    pub reply_delivered: bool,
    /// Nothing more will happen to it: its (last) reply was delivered, or
    /// its connection closed.
    pub settled: bool,
}

impl Exchange {
    /// Whether `key` is a field name anywhere in the body, e.g. `$pull` in
    /// one of an `update`'s statements.
    pub fn body_mentions(&self, key: &str) -> bool {
        document_mentions(&self.body, key)
    }
}

fn document_mentions(document: &Document, key: &str) -> bool {
    document
        .iter()
        .any(|(name, value)| name == key || value_mentions(value, key))
}

fn value_mentions(value: &Bson, key: &str) -> bool {
    match value {
        Bson::Document(document) => document_mentions(document, key),
        Bson::Array(values) => values.iter().any(|v| value_mentions(v, key)),
        _ => false,
    }
}

/// The log with stable sequence numbers, so pumps can update an entry after
/// [`Proxy::clear_log`] dropped earlier ones.
#[derive(Default)]
struct Log {
    first_seq: u64,
    entries: Vec<Exchange>,
}

/// State shared by the proxy handle, its rule guards and its pumps.
struct Shared {
    rules: Mutex<Vec<ActiveRule>>,
    next_rule_id: AtomicU64,
    log: Mutex<Log>,
    /// Bumped on every log change, so waiters wake instead of polling.
    log_changed: watch::Sender<u64>,
    next_connection: AtomicU64,
    next_reply_id: AtomicI32,
    /// Bumped by [`Proxy::release_held`]: every request held before is
    /// forwarded.
    releases: AtomicU64,
    /// How many requests the proxy began to forward.
    forwarded: AtomicU64,
}

/// Locks past poisoning: a panic elsewhere (a test's assertion) must not
/// make the pumps panic in turn, and every update here is a single store.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// The action of the first installed rule selecting `message`. Every rule
    /// sees every request, so each rule's `nth` and draws do not depend on
    /// the other rules.
    fn choose_action(&self, message: &WireMessage) -> Option<Action> {
        let mut chosen = None;
        for rule in lock(&self.rules).iter_mut() {
            if rule.selects(message) && chosen.is_none() {
                chosen = Some(rule.rule.action.clone());
            }
        }
        chosen
    }

    fn record(&self, exchange: Exchange) -> u64 {
        let seq = {
            let mut log = lock(&self.log);
            log.entries.push(exchange);
            log.first_seq + log.entries.len() as u64 - 1
        };
        self.log_changed.send_modify(|v| *v += 1);
        seq
    }

    fn update(&self, seq: u64, change: impl FnOnce(&mut Exchange)) {
        {
            let mut log = lock(&self.log);
            let Some(index) = seq.checked_sub(log.first_seq) else {
                return;
            };
            let Some(exchange) = log.entries.get_mut(index as usize) else {
                return;
            };
            change(exchange);
        }
        self.log_changed.send_modify(|v| *v += 1);
    }

    /// Marks every request of a closed connection settled, except the one
    /// it holds (`held`, a sequence number), which is yet to be forwarded.
    fn settle_connection(&self, connection: u64, held: Option<u64>) {
        {
            let mut log = lock(&self.log);
            let first_seq = log.first_seq;
            for (i, exchange) in log.entries.iter_mut().enumerate() {
                if exchange.connection == connection && held != Some(first_seq + i as u64) {
                    exchange.settled = true;
                }
            }
        }
        self.log_changed.send_modify(|v| *v += 1);
    }

    /// Gives the request `seq` the next place in the order in which the
    /// proxy forwards requests to the server.
    fn number_forwarding(&self, seq: u64) {
        let place = self.forwarded.fetch_add(1, Ordering::SeqCst);
        self.update(seq, |e| e.forwarded = Some(place));
    }

    /// Whether `held` may be forwarded now.
    fn released(&self, held: &Held) -> bool {
        if self.releases.load(Ordering::SeqCst) > held.releases_before {
            return true;
        }
        let Release::AfterLaterReplies(n) = held.release else {
            return false;
        };
        let log = lock(&self.log);
        let later = log.entries.iter().enumerate().filter(|(i, e)| {
            log.first_seq + *i as u64 > held.seq
                && e.command == held.command
                && e.collection == held.collection
                && e.reply_delivered
        });
        later.count() >= n
    }

    /// Waits until `held` may be forwarded.
    async fn until_released(&self, held: &Held) {
        let mut changed = self.log_changed.subscribe();
        while !self.released(held) {
            if changed.changed().await.is_err() {
                return;
            }
        }
    }
}

/// A running proxy. Dropping it stops accepting and closes every connection
/// it carries.
pub struct Proxy {
    address: SocketAddr,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`
    /// (`host:port`). Panics if `upstream` cannot be reached, so a wrong
    /// address fails the test at once instead of as a timeout later.
    pub async fn start(upstream: &str) -> Self {
        if let Err(err) = TcpStream::connect(upstream).await {
            panic!("the proxy cannot reach its upstream {upstream}: {err}");
        }
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port for the proxy");
        let address = listener.local_addr().expect("the proxy's local address");
        let shared = Arc::new(Shared {
            rules: Mutex::new(Vec::new()),
            next_rule_id: AtomicU64::new(1),
            log: Mutex::new(Log::default()),
            log_changed: watch::channel(0).0,
            next_connection: AtomicU64::new(1),
            next_reply_id: AtomicI32::new(1 << 30),
            releases: AtomicU64::new(0),
            forwarded: AtomicU64::new(0),
        });
        let shutdown = CancellationToken::new();
        tokio::spawn(accept_connections(
            listener,
            upstream.to_owned(),
            shared.clone(),
            shutdown.clone(),
        ));
        Self {
            address,
            shared,
            shutdown,
        }
    }

    /// A URI that reaches the upstream through the proxy. Direct connection:
    /// the driver must not discover the real members and bypass the proxy.
    pub fn uri(&self) -> String {
        format!("mongodb://{}/?directConnection=true", self.address)
    }

    /// The loopback address the proxy listens on.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Installs `rule` before the existing ones: it wins over them (e.g. a
    /// refusal in front of a mock's answer); it stays until the guard is
    /// dropped.
    pub fn rule_first(&self, rule: Rule) -> RuleGuard {
        let guard = self.rule(rule);
        let mut rules = lock(&self.shared.rules);
        if let Some(last) = rules.pop() {
            rules.insert(0, last);
        }
        guard
    }

    /// Installs `rule` after the existing ones (the first installed rule that
    /// selects a request wins); it stays until the guard is dropped.
    pub fn rule(&self, rule: Rule) -> RuleGuard {
        let id = self.shared.next_rule_id.fetch_add(1, Ordering::Relaxed);
        let random = rule
            .matcher
            .probability
            .map(|(p, seed)| (p, fastrand::Rng::with_seed(seed)));
        lock(&self.shared.rules).push(ActiveRule {
            id,
            rule,
            selected: 0,
            random,
        });
        RuleGuard {
            shared: self.shared.clone(),
            id,
        }
    }

    /// Every client request since the start (or the last
    /// [`clear_log`](Self::clear_log)), in arrival order.
    pub fn log(&self) -> Vec<Exchange> {
        lock(&self.shared.log).entries.clone()
    }

    /// The logged requests named `command`, in arrival order.
    pub fn requests(&self, command: &str) -> Vec<Exchange> {
        lock(&self.shared.log)
            .entries
            .iter()
            .filter(|e| e.command.as_deref() == Some(command))
            .cloned()
            .collect()
    }

    /// Forwards every request held so far ([`Action::HoldRequest`]) and
    /// waits until each got the server's reply (or its connection closed);
    /// returns their exchanges, in arrival order.
    pub async fn release_held(&self) -> Vec<Exchange> {
        self.shared.releases.fetch_add(1, Ordering::SeqCst);
        self.shared.log_changed.send_modify(|v| *v += 1);
        let held = |e: &Exchange| matches!(e.action, Some(Action::HoldRequest(_)));
        let log = self
            .wait_until("every held request is forwarded", HELD_PATIENCE, |log| {
                log.iter().filter(|e| held(e)).all(|e| e.settled)
            })
            .await;
        log.into_iter().filter(held).collect()
    }

    /// Forgets the log so far (rules and their counters are kept).
    pub fn clear_log(&self) {
        let mut log = lock(&self.shared.log);
        log.first_seq += log.entries.len() as u64;
        log.entries.clear();
    }

    /// Waits until `done` holds for the log and returns that log; panics
    /// with `what` and the log after `timeout`. Wakes on every log change,
    /// so it costs no sleeping.
    pub async fn wait_until(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[Exchange]) -> bool,
    ) -> Vec<Exchange> {
        let mut changed = self.shared.log_changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let log = self.log();
            if done(&log) {
                return log;
            }
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                _ => panic!("timed out after {timeout:?} waiting until {what}; log: {log:#?}"),
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn accept_connections(
    listener: TcpListener,
    upstream: String,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        // A failed accept (the client gave up already) is not the proxy's end.
        if let Ok((client, _)) = accepted {
            tokio::spawn(carry_connection(
                client,
                upstream.clone(),
                shared.clone(),
                shutdown.clone(),
            ));
        }
    }
}

/// Carries one client connection until either side closes, a rule closes it,
/// or the proxy shuts down; then closes both sides.
async fn carry_connection(
    client: TcpStream,
    upstream: String,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
) {
    let connection = shared.next_connection.fetch_add(1, Ordering::Relaxed);
    let server = tokio::select! {
        _ = shutdown.cancelled() => return,
        server = TcpStream::connect(&upstream) => server,
    };
    let Ok(server) = server else {
        return;
    };
    // Small messages must not wait for Nagle: the proxy must not change timing.
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let pair = Pair {
        shared,
        connection,
        client_write: tokio::sync::Mutex::new(client_write),
        pending: Mutex::new(HashMap::new()),
    };
    let held = tokio::select! {
        _ = shutdown.cancelled() => None,
        held = pair.pump_requests(client_read, &mut server_write) => held,
        _ = pair.pump_replies(&mut server_read) => None,
    };
    // The pumps are dropped here, and with the pair the client's side of the
    // connection: a held request's attempt fails now.
    let Pair {
        shared,
        client_write,
        ..
    } = pair;
    drop(client_write);
    shared.settle_connection(connection, held.as_ref().map(|h| h.seq));
    if let Some(held) = held {
        forward_held(&shared, held, server_write, server_read, shutdown).await;
    }
}

/// A request the proxy holds back ([`Action::HoldRequest`]).
struct Held {
    seq: u64,
    request_id: i32,
    bytes: Vec<u8>,
    command: Option<String>,
    collection: Option<String>,
    release: Release,
    /// [`Shared::releases`] when it was held: a later release forwards it.
    releases_before: u64,
}

/// Forwards `held` on its own upstream connection once it is released, and
/// records the server's reply; the client is gone, so nothing is delivered.
async fn forward_held(
    shared: &Shared,
    held: Held,
    mut server_write: OwnedWriteHalf,
    mut server_read: OwnedReadHalf,
    shutdown: CancellationToken,
) {
    let released = tokio::select! {
        _ = shutdown.cancelled() => false,
        () = shared.until_released(&held) => true,
    };
    if released {
        shared.number_forwarding(held.seq);
    }
    if released && server_write.write_all(&held.bytes).await.is_ok() {
        shared.update(held.seq, |e| e.reached_server = true);
        loop {
            let read = tokio::select! {
                _ = shutdown.cancelled() => break,
                read = read_message(&mut server_read) => read,
            };
            let Ok(bytes) = read else { break };
            let reply =
                WireMessage::parse(&bytes).unwrap_or_else(|_| WireMessage::header_only(&bytes));
            if reply.response_to == held.request_id {
                shared.update(held.seq, |e| {
                    e.server_replied = true;
                    e.server_replies += 1;
                    e.reply = Some(reply.body);
                });
                break;
            }
        }
    }
    shared.update(held.seq, |e| e.settled = true);
}

/// A request forwarded upstream whose reply has not come back yet.
struct Pending {
    seq: u64,
    action: Option<Action>,
}

/// One client connection and its upstream connection.
struct Pair {
    shared: Arc<Shared>,
    connection: u64,
    /// Shared by both pumps: replies and injected errors go to the client.
    client_write: tokio::sync::Mutex<OwnedWriteHalf>,
    /// Forwarded requests by `requestID`, awaiting their reply.
    pending: Mutex<HashMap<i32, Pending>>,
}

impl Pair {
    async fn deliver(&self, bytes: &[u8]) -> io::Result<()> {
        self.client_write.lock().await.write_all(bytes).await
    }

    /// Client to server. Returns when the pair must close: with the request
    /// it holds, if that is why.
    async fn pump_requests(
        &self,
        mut client_read: OwnedReadHalf,
        server_write: &mut OwnedWriteHalf,
    ) -> Option<Held> {
        while let Ok(bytes) = read_message(&mut client_read).await {
            let message =
                WireMessage::parse(&bytes).unwrap_or_else(|_| WireMessage::header_only(&bytes));
            // A message the proxy cannot parse is still forwarded; rules need
            // a parsed OP_MSG.
            let parsed = message.command.is_some();
            let expects_reply = message.expects_reply();
            let action = if parsed && message.opcode == OP_MSG && expects_reply {
                self.shared.choose_action(&message)
            } else {
                None
            };
            let seq = self.shared.record(Exchange {
                connection: self.connection,
                request_id: message.request_id,
                opcode: message.opcode,
                command: message.command.clone(),
                collection: message.collection.clone(),
                body: message.body.clone(),
                expects_reply,
                action: action.clone(),
                reached_server: false,
                forwarded: None,
                server_replied: false,
                server_replies: 0,
                reply: None,
                reply_delivered: false,
                settled: false,
            });
            // Injected answers: the request never reaches the server.
            let reply_id = || self.shared.next_reply_id.fetch_add(1, Ordering::Relaxed);
            let injected = match &action {
                Some(Action::CloseBeforeForwarding) => return None,
                Some(Action::HoldRequest(release)) => {
                    return Some(Held {
                        seq,
                        request_id: message.request_id,
                        bytes,
                        command: message.command,
                        collection: message.collection,
                        release: *release,
                        releases_before: self.shared.releases.load(Ordering::SeqCst),
                    });
                }
                Some(Action::DuplicateKey) => Some(duplicate_key_reply(&message, reply_id())),
                Some(Action::Answer(body)) => {
                    Some(answer_reply(body, reply_id(), message.request_id))
                }
                Some(Action::Error {
                    code,
                    code_name,
                    labels,
                }) => Some(error_reply(
                    *code,
                    code_name,
                    labels,
                    reply_id(),
                    message.request_id,
                )),
                _ => None,
            };
            if let Some(reply) = injected {
                if self.deliver(&reply).await.is_err() {
                    return None;
                }
                self.shared.update(seq, |e| {
                    e.reply_delivered = true;
                    e.settled = true;
                });
                continue;
            }
            if expects_reply {
                // Registered before writing: the reply may race the bookkeeping.
                lock(&self.pending).insert(message.request_id, Pending { seq, action });
            }
            self.shared.number_forwarding(seq);
            if server_write.write_all(&bytes).await.is_err() {
                return None;
            }
            self.shared.update(seq, |e| {
                e.reached_server = true;
                e.settled |= !expects_reply;
            });
        }
        None
    }

    /// Server to client. Returns when the pair must close.
    async fn pump_replies(&self, server_read: &mut OwnedReadHalf) {
        while let Ok(bytes) = read_message(server_read).await {
            let reply =
                WireMessage::parse(&bytes).unwrap_or_else(|_| WireMessage::header_only(&bytes));
            let pending = {
                let mut pending = lock(&self.pending);
                let request = pending.remove(&reply.response_to);
                if let Some(request) = &request {
                    // Forget the other key of a stream (see below).
                    pending.retain(|_, other| other.seq != request.seq);
                    // Exhaust: more replies follow for the same request, with
                    // no action left to apply. mongod makes each answer the
                    // previous reply, SecantusDB the request: accept both.
                    if reply.more_to_come() {
                        // An amended stream stays amended (a mongos says
                        // so in every `hello`); no other action repeats.
                        let kept = match &request.action {
                            Some(Action::AmendReply(fields)) => {
                                Some(Action::AmendReply(fields.clone()))
                            }
                            _ => None,
                        };
                        for key in [reply.response_to, reply.request_id] {
                            let next = Pending {
                                seq: request.seq,
                                action: kept.clone(),
                            };
                            pending.insert(key, next);
                        }
                    }
                }
                request
            };
            let Some(Pending { seq, action }) = pending else {
                if self.deliver(&bytes).await.is_err() {
                    return;
                }
                continue;
            };
            let body = reply.body.clone();
            self.shared.update(seq, |e| {
                e.reached_server = true;
                e.server_replied = true;
                e.server_replies += 1;
                if e.reply.is_none() && !body.is_empty() {
                    e.reply = Some(body);
                }
            });
            let bytes = match action {
                Some(Action::DropReply) => return,
                Some(Action::DelayReply(delay)) => {
                    tokio::time::sleep(delay).await;
                    bytes
                }
                Some(Action::WriteConcernError {
                    code,
                    code_name,
                    labels,
                }) => with_write_concern_error(&reply, code, &code_name, &labels),
                Some(Action::AmendReply(fields)) => amended(&reply, &fields),
                _ => bytes,
            };
            if self.deliver(&bytes).await.is_err() {
                return;
            }
            let last = !reply.more_to_come();
            self.shared.update(seq, |e| {
                e.reply_delivered = true;
                e.settled = last;
            });
        }
    }
}

/// Reads one whole message. Any error (a disconnect is the usual one) means
/// the pair must close.
async fn read_message(reader: &mut (impl AsyncRead + Unpin)) -> io::Result<Vec<u8>> {
    let mut length = [0u8; 4];
    reader.read_exact(&mut length).await?;
    let length = usize::try_from(i32::from_le_bytes(length))
        .ok()
        .filter(|l| (HEADER_BYTES..=MAX_MESSAGE_BYTES).contains(l))
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad message length"))?;
    let mut bytes = vec![0u8; length];
    bytes[..4].copy_from_slice(&(length as i32).to_le_bytes());
    reader.read_exact(&mut bytes[4..]).await?;
    Ok(bytes)
}

/// The `host:port` a proxy should front for the server at `uri`: the host
/// itself for a direct connection (the local test server), else the replica
/// set's primary as `hello` reports it, so writes through a proxy with
/// `directConnection` reach the member that accepts them.
pub async fn upstream_of(uri: &str) -> String {
    let options = ClientOptions::parse(uri)
        .await
        .unwrap_or_else(|err| panic!("cannot parse the test URI: {err}"));
    assert!(
        !matches!(options.tls, Some(Tls::Enabled(_))),
        "the test proxy reads plain wire messages; it cannot front a TLS server ({uri})"
    );
    let first_host = options
        .hosts
        .first()
        .map(ToString::to_string)
        .expect("the test URI names no host");
    if options.direct_connection == Some(true) {
        return first_host;
    }
    let client = Client::with_options(options).expect("client for the test URI");
    let hello = client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await
        .unwrap_or_else(|err| panic!("`hello` on the test server failed: {err}"));
    // A standalone or mongos has no `primary`: it is its own upstream.
    hello
        .get_str("primary")
        .map(str::to_owned)
        .unwrap_or(first_host)
}
