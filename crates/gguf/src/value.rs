//! GGUF metadata values.
//!
//! GGUF stores thirteen value kinds, identified on disk by a `u32` type id.
//! [`Value`] mirrors them one to one so that a file can be read and written
//! back without changing any type (llama.cpp, for instance, insists that
//! `general.alignment` is a `u32`). Conversions used by the typed getters live
//! here too, so that "which stored types are acceptable as a u32" is decided
//! in one place.

use std::fmt;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    /// GGUF arrays carry one element type; [`crate::GgufWriter`] enforces
    /// this, and the reader produces nothing else.
    Array(Vec<Value>),
}

/// The on-disk type ids of GGUF metadata values.
pub(crate) mod type_id {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// Elements shown by `Display` before an array is abbreviated.
const DISPLAY_ARRAY_ITEMS: usize = 8;

impl Value {
    /// The on-disk type id.
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => type_id::U8,
            Value::I8(_) => type_id::I8,
            Value::U16(_) => type_id::U16,
            Value::I16(_) => type_id::I16,
            Value::U32(_) => type_id::U32,
            Value::I32(_) => type_id::I32,
            Value::U64(_) => type_id::U64,
            Value::I64(_) => type_id::I64,
            Value::F32(_) => type_id::F32,
            Value::F64(_) => type_id::F64,
            Value::Bool(_) => type_id::BOOL,
            Value::String(_) => type_id::STRING,
            Value::Array(_) => type_id::ARRAY,
        }
    }

    /// Short type name: `u8` .. `f64`, `bool`, `string`, `array`.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// Type name with the element type of arrays, e.g. `array<string>`; used in error messages.
    pub fn describe_type(&self) -> String {
        match self {
            Value::Array(items) => match items.first() {
                Some(first) => format!("array<{}>", first.describe_type()),
                None => "array<>".to_owned(),
            },
            other => other.type_name().to_owned(),
        }
    }

    /// Any integer type, as `i128` (which holds every u64 and i64).
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any integer type whose value is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// Any integer type whose value fits an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// Floats, and integers converted (rounding to nearest for very large ones).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// Human-readable form for `quire info`: strings are quoted and escaped (so one
/// value is always one line), arrays longer than eight items are abbreviated
/// unless the alternate flag (`{:#}`) is given.
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array(items) => {
                let shown = if f.alternate() {
                    items.len()
                } else {
                    items.len().min(DISPLAY_ARRAY_ITEMS)
                };
                f.write_str("[")?;
                for (i, item) in items[..shown].iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    fmt::Display::fmt(item, f)?;
                }
                if shown < items.len() {
                    write!(f, ", ... ({} items)", items.len())?;
                }
                f.write_str("]")
            }
        }
    }
}

impl From<u8> for Value {
    fn from(v: u8) -> Self {
        Value::U8(v)
    }
}
impl From<i8> for Value {
    fn from(v: i8) -> Self {
        Value::I8(v)
    }
}
impl From<u16> for Value {
    fn from(v: u16) -> Self {
        Value::U16(v)
    }
}
impl From<i16> for Value {
    fn from(v: i16) -> Self {
        Value::I16(v)
    }
}
impl From<u32> for Value {
    fn from(v: u32) -> Self {
        Value::U32(v)
    }
}
impl From<i32> for Value {
    fn from(v: i32) -> Self {
        Value::I32(v)
    }
}
impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::U64(v)
    }
}
impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::I64(v)
    }
}
impl From<f32> for Value {
    fn from(v: f32) -> Self {
        Value::F32(v)
    }
}
impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::F64(v)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::String(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::String(v.to_owned())
    }
}
impl<T: Into<Value>> From<Vec<T>> for Value {
    fn from(v: Vec<T>) -> Self {
        Value::Array(v.into_iter().map(Into::into).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_views() {
        assert_eq!(Value::I8(-1).as_u64(), None);
        assert_eq!(Value::I8(-1).as_i64(), Some(-1));
        assert_eq!(Value::U64(u64::MAX).as_u64(), Some(u64::MAX));
        assert_eq!(Value::U64(u64::MAX).as_i64(), None);
        assert_eq!(Value::F32(1.0).as_u64(), None);
        assert_eq!(Value::U16(7).as_f64(), Some(7.0));
        assert_eq!(Value::Bool(true).as_f64(), None);
    }

    #[test]
    fn display_is_one_line_and_abbreviates() {
        assert_eq!(Value::from("a\nb").to_string(), "\"a\\nb\"");
        let v = Value::from((0u32..20).collect::<Vec<_>>());
        assert_eq!(v.to_string(), "[0, 1, 2, 3, 4, 5, 6, 7, ... (20 items)]");
        assert_eq!(format!("{v:#}").matches(',').count(), 19);
        assert_eq!(v.describe_type(), "array<u32>");
        let nested = Value::Array(vec![Value::from(vec![1i8]), Value::from(vec![2i8])]);
        assert_eq!(nested.to_string(), "[[1], [2]]");
        assert_eq!(nested.describe_type(), "array<array<i8>>");
    }
}
