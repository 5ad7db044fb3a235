//! Who may do what: the bearer tokens of `[api]` (from the environment,
//! stored as SHA-256), each scoped to verbs and collections.
//!
//! A request's token is hashed and compared with **every** stored hash in
//! constant time (`subtle`), so neither which token matched nor how much
//! of it did shows in the time the answer takes. With no token configured
//! the API is open (the configuration allows that only on loopback, or
//! when `serve_without` says so). A token never reaches a log, a metric or
//! an answer: they name it by its name.

use axum::http::{HeaderMap, header};
use subtle::ConstantTimeEq;

use super::problem::{Kind, Problem};
use crate::config::{ApiToken, Verb, token_hash};

/// The tokens a run of the API accepts.
#[derive(Debug, Clone, Default)]
pub(crate) struct Access {
    tokens: Vec<ApiToken>,
}

impl Access {
    /// Access by `tokens`; none: open.
    pub(crate) fn new(tokens: Vec<ApiToken>) -> Self {
        Self { tokens }
    }

    /// Whether the request with `headers` may use `verb` on `collection`:
    /// the token's name (`None` when the API is open), or the refusal —
    /// 401 without a token the daemon knows, 403 for one without the scope.
    #[cfg(test)]
    pub(crate) fn check(
        &self,
        headers: &HeaderMap,
        verb: Verb,
        collection: &str,
    ) -> Result<Option<String>, Problem> {
        let token = self.identify(headers)?;
        Self::authorize(token, verb, collection)
    }

    /// Whether `token` (from [`Access::identify`]) may use `verb` on
    /// `collection`: its name, or 403.
    pub(crate) fn authorize(
        token: Option<&ApiToken>,
        verb: Verb,
        collection: &str,
    ) -> Result<Option<String>, Problem> {
        let Some(token) = token else {
            return Ok(None);
        };
        if token.allows(verb, collection) {
            return Ok(Some(token.name.clone()));
        }
        Err(Problem::new(
            Kind::Forbidden,
            format!(
                "the token {} may not {} {collection} (its scopes: {}); use a token with \
                 {}:{collection}, or add that scope to its line in the environment file",
                token.name,
                verb.as_str(),
                token.scopes_text(),
                verb.as_str()
            ),
        ))
    }

    /// The stored token the request presents: `None` when the API is open;
    /// 401 without an `Authorization: Bearer` header or with a token no
    /// stored hash matches.
    pub(crate) fn identify(&self, headers: &HeaderMap) -> Result<Option<&ApiToken>, Problem> {
        if self.tokens.is_empty() {
            return Ok(None);
        }
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| {
                let (scheme, token) = value.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            });
        let Some(presented) = presented else {
            return Err(Problem::new(
                Kind::Unauthenticated,
                "this API needs a bearer token: send the header `Authorization: Bearer TOKEN` \
                 (an operator makes one with `tallyd api-token NAME`)",
            ));
        };
        let hash = token_hash(presented);
        // Every stored hash is compared, whatever matched before.
        let mut found = None;
        for token in &self.tokens {
            if bool::from(token.hash.ct_eq(&hash)) {
                found = Some(token);
            }
        }
        found.map(Some).ok_or_else(|| {
            Problem::new(
                Kind::Unauthenticated,
                "the bearer token is not one this daemon knows (a typo, or a token removed \
                 from the environment file): send a valid one",
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn access() -> Access {
        Access::new(vec![
            ApiToken {
                name: "billing".into(),
                hash: token_hash("tally_billing"),
                scopes: vec![(Verb::Record, Some("orders".into()))],
            },
            ApiToken {
                name: "dashboard".into(),
                hash: token_hash("tally_dashboard"),
                scopes: vec![(Verb::Read, None)],
            },
        ])
    }

    fn bearer(token: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let value = HeaderValue::from_str(&format!("Bearer {token}")).unwrap();
        headers.insert(header::AUTHORIZATION, value);
        headers
    }

    #[test]
    fn tokens_are_checked_by_hash_and_scope() {
        let access = access();
        let allowed = access.check(&bearer("tally_billing"), Verb::Record, "orders");
        assert_eq!(allowed.unwrap().as_deref(), Some("billing"));
        let read = access.check(&bearer("tally_dashboard"), Verb::Read, "orders");
        assert_eq!(read.unwrap().as_deref(), Some("dashboard"));
        let wrong_verb = access.check(&bearer("tally_dashboard"), Verb::Record, "orders");
        assert_eq!(wrong_verb.unwrap_err().kind(), Kind::Forbidden);
        let wrong_collection = access.check(&bearer("tally_billing"), Verb::Record, "views");
        let refused = wrong_collection.unwrap_err();
        assert_eq!(refused.kind(), Kind::Forbidden);
        assert!(!refused.body().to_string().contains("tally_billing"));
        let unknown = access.check(&bearer("tally_guess"), Verb::Read, "orders");
        assert_eq!(unknown.unwrap_err().kind(), Kind::Unauthenticated);
        let none = access.check(&HeaderMap::new(), Verb::Read, "orders");
        assert_eq!(none.unwrap_err().kind(), Kind::Unauthenticated);
    }

    #[test]
    fn without_tokens_the_api_is_open() {
        let open = Access::default().check(&HeaderMap::new(), Verb::Record, "orders");
        assert_eq!(open.unwrap(), None);
    }
}
