//! JSON as clients send it, read strictly: an object that names a key twice
//! is refused (`serde_json` keeps the last silently, so two readers of one
//! body could disagree on what it says).

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Parse `bytes` as one JSON document whose objects name each key once.
pub fn parse(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    serde_json::from_slice::<Strict>(bytes).map(|strict| strict.0)
}

/// Parse `text` as [`parse`] does.
pub fn parse_str(text: &str) -> Result<Value, serde_json::Error> {
    parse(text.as_bytes())
}

struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(Strict(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(de::Error::custom(format_args!(
                    "the key {key:?} appears twice in one object"
                )));
            }
            let Strict(value) = map.next_value()?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_key_named_twice_is_refused_anywhere_and_everything_else_reads_as_serde_json_does() {
        for doc in [
            r#"{"a": 1, "a": 2}"#,
            r#"{"x": [{"b": true, "b": false}]}"#,
            r#"{"o": {"k": null, "k": null}}"#,
        ] {
            let err = parse_str(doc).unwrap_err().to_string();
            assert!(err.contains("appears twice"), "{doc}: {err}");
        }
        let doc = r#"{"a": [1, -2, 3.5, 18446744073709551615, "s\u0000", null, {}], "b": {"c": false}}"#;
        assert_eq!(parse_str(doc).unwrap(), serde_json::from_str::<Value>(doc).unwrap());
        assert_eq!(parse_str("[]").unwrap(), json!([]));
        assert!(parse_str("{").is_err());
        assert!(parse_str("1 2").is_err(), "trailing data");
        // serde_json's nesting limit holds for this reader too.
        let deep = "[".repeat(10_000) + &"]".repeat(10_000);
        assert!(parse_str(&deep).is_err());
    }
}
