//! Types with one textual form (`"auto"`, `"cuda:1"`, `"bf16"`) in TOML, JSON and on the
//! command line: serialised as their `Display` text, deserialised through `FromStr`, so the
//! error a config file gets is the same one `--flag value` gets, listing what is allowed.

/// A config value given as a string or a bare integer (`pad_to_multiple_of = 128`), as text.
pub(crate) struct TextValue(pub String);

impl<'de> serde::Deserialize<'de> for TextValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = TextValue;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or an integer")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<TextValue, E> {
                Ok(TextValue(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<TextValue, E> {
                Ok(TextValue(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<TextValue, E> {
                Ok(TextValue(v.to_string()))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Implements `Serialize` (the `Display` text) and `Deserialize` (through `FromStr`, keeping its
/// error message) for each type.
macro_rules! serde_via_str {
    ($($ty:ty),+ $(,)?) => {$(
        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = <$crate::util::TextValue as serde::Deserialize>::deserialize(d)?;
                text.0.parse().map_err(serde::de::Error::custom)
            }
        }
    )+};
}

pub(crate) use serde_via_str;
