//! The filter of a counter by its `_id`, and of an event by its counter:
//! the same document on every server, found through an index on each.
//!
//! A bucketed `_id` is a document, `{k: key, t: <bucket start>}`, and the
//! test server answers an equality with a document value by scanning the
//! collection (MongoDB serves it from the `_id` index). So a bucketed `_id`
//! is asked for by its dotted fields as well, which the index `{<path>.k:
//! 1, <path>.t: 1}` serves on every server, beside the equality on the
//! whole `_id`, which keeps the match exact (field order and all) and makes
//! an upsert create exactly that `_id`. The dotted fields are asked as
//! ranges of one value, `{$gte: v, $lte: v}`, not as equalities: MongoDB
//! builds an upsert's new document from the filter's equalities and
//! refuses one that names both `_id` and `_id.k` ("cannot infer query
//! fields to set", code 54), while a range seeds nothing; and a range's
//! operand is a value, never read as a query operator, whatever the key
//! holds. A plain key's filter is `{<path>: key}`, byte for byte what it
//! always was.
//!
//! On the test server the index finds the key's buckets by its prefix
//! (`_id.k`), and the rest of the filter picks the bucket among them: a
//! filter that names the whole `_id` too never takes its compound lookup.
//! A write costs in proportion to the key's buckets, not the collection's
//! documents.

use std::collections::HashSet;

use mongodb::bson::{Bson, Document, doc};

use super::{KEY, START};
use crate::document::CanonicalKey;

/// The key and the bucket start (a Date) of a bucketed `_id`, as stored.
fn parts(id: &Bson) -> Option<(&Bson, &Bson)> {
    let Bson::Document(fields) = id else {
        return None;
    };
    let key = fields.get(KEY)?;
    let start = fields
        .get(START)
        .filter(|t| matches!(t, Bson::DateTime(_)))?;
    (fields.len() == 2).then_some((key, start))
}

/// The filter of the document whose `path` (`_id`, or an event's counter
/// field) is `id`: `{<path>: id}` for a plain key; for a bucketed `_id`
/// `{<path>.k: {$gte: k, $lte: k}, <path>.t: {$gte: t, $lte: t}, <path>:
/// id}`. Callers add their own conditions after it.
pub(crate) fn by_id(path: &str, id: &Bson) -> Document {
    let Some((key, start)) = parts(id) else {
        return doc! { path: id.clone() };
    };
    let one = |value: &Bson| doc! { "$gte": value.clone(), "$lte": value.clone() };
    doc! {
        format!("{path}.{KEY}"): one(key),
        format!("{path}.{START}"): one(start),
        path: id.clone(),
    }
}

/// The filter of the documents whose `path` is one of `ids`: `{<path>:
/// {$in: ids}}`, and when every one is a bucketed `_id`, the keys and the
/// starts among them as `$in`s of the dotted fields first (one index
/// lookup per pair; a pair that is no id of `ids` is dropped by the `_id`
/// `$in`). `$in`s read only: an upsert takes [`by_id`].
pub(crate) fn by_any(path: &str, ids: &[Bson]) -> Document {
    let mut keys: Vec<Bson> = Vec::new();
    let mut starts: Vec<Bson> = Vec::new();
    let (mut seen_keys, mut seen_starts) = (HashSet::new(), HashSet::new());
    for id in ids {
        let Some((key, start)) = parts(id) else {
            return doc! { path: { "$in": ids.to_vec() } };
        };
        if seen_keys.insert(CanonicalKey::of(key)) {
            keys.push(key.clone());
        }
        if seen_starts.insert(CanonicalKey::of(start)) {
            starts.push(start.clone());
        }
    }
    if ids.is_empty() {
        return doc! { path: { "$in": [] } };
    }
    doc! {
        format!("{path}.{KEY}"): { "$in": keys },
        format!("{path}.{START}"): { "$in": starts },
        path: { "$in": ids.to_vec() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::DateTime;

    fn bucket(key: &str, millis: i64) -> Bson {
        Bson::Document(doc! { KEY: key, START: DateTime::from_millis(millis) })
    }

    #[test]
    fn a_plain_key_is_asked_for_as_it_always_was() {
        for key in [
            Bson::from("home"),
            Bson::from(7),
            Bson::Document(doc! { "k": "x" }),
        ] {
            assert_eq!(by_id("_id", &key), doc! { "_id": key.clone() });
        }
        // A `t` that is no Date, or a third field: not a bucket.
        let not = Bson::Document(doc! { KEY: "a", START: 5 });
        assert_eq!(by_id("_id", &not), doc! { "_id": not.clone() });
        let three = Bson::Document(doc! { KEY: "a", START: DateTime::from_millis(0), "x": 1 });
        assert_eq!(by_id("k", &three), doc! { "k": three.clone() });
        let plain = [Bson::from("a"), bucket("b", 0)];
        assert_eq!(
            by_any("_id", &plain),
            doc! { "_id": { "$in": plain.to_vec() } }
        );
    }

    #[test]
    fn a_bucketed_id_is_asked_for_by_its_dotted_fields_and_itself() {
        let id = bucket("home", 1_000);
        let t = DateTime::from_millis(1_000);
        assert_eq!(
            by_id("_id", &id),
            doc! {
                "_id.k": { "$gte": "home", "$lte": "home" },
                "_id.t": { "$gte": t, "$lte": t },
                "_id": id.clone(),
            }
        );
        // A key that looks like an operator stays a value in a range.
        let sly = Bson::Document(doc! { KEY: { "$gt": "" }, START: t });
        let filter = by_id("k", &sly);
        assert_eq!(
            filter.get_document("k.k").unwrap().get("$gte"),
            Some(&Bson::Document(doc! { "$gt": "" }))
        );
        assert_eq!(filter.get("k"), Some(&sly));
    }

    #[test]
    fn many_bucketed_ids_are_asked_for_by_their_distinct_keys_and_starts() {
        let ids = [bucket("a", 0), bucket("a", 10), bucket("b", 10)];
        let (t0, t10) = (DateTime::from_millis(0), DateTime::from_millis(10));
        assert_eq!(
            by_any("k", &ids),
            doc! {
                "k.k": { "$in": ["a", "b"] },
                "k.t": { "$in": [t0, t10] },
                "k": { "$in": ids.to_vec() },
            }
        );
        assert_eq!(by_any("_id", &[]), doc! { "_id": { "$in": [] } });
    }
}
