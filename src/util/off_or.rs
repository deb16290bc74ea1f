//! `Option` settings whose default is on (`max_grad_norm = 1.0`, `logging_steps = 1`): in a
//! config file a missing key means the default, so "off" needs a value of its own. `None` is
//! written `"off"`; a number or `"off"` (also `"none"`) is read. Use as
//! `#[serde(with = "crate::util::off_or")]`.

use serde::{Deserialize, Deserializer, Serialize, Serializer, de::Error};

/// `Some(v)` as `v`, `None` as `"off"`.
pub(crate) fn serialize<S: Serializer, T: Serialize>(value: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
    match value {
        Some(v) => v.serialize(s),
        None => s.serialize_str("off"),
    }
}

/// A value, or `"off"` / `"none"` for `None`.
pub(crate) fn deserialize<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw<T> {
        Value(T),
        Word(String),
    }
    match Raw::<T>::deserialize(d)? {
        Raw::Value(v) => Ok(Some(v)),
        Raw::Word(w) if w.eq_ignore_ascii_case("off") || w.eq_ignore_ascii_case("none") => Ok(None),
        Raw::Word(w) => Err(D::Error::custom(format!("expected a number or \"off\", got {w:?}"))),
    }
}
