//! Typed metadata getters.
//!
//! Converters disagree on integer widths (one writes `block_count` as u32,
//! another as u64 or i32), so the integer getters accept any integer type
//! whose value fits, and the float getters accept integers too. What they do
//! not do is guess across kinds: a string where a number is expected is an
//! error naming the key, not `None`, so that a broken model fails loudly at
//! load time instead of silently falling back to a default.

use crate::error::GgufError;
use crate::reader::GgufHeader;
use crate::value::Value;

fn wrong_type(key: &str, expected: &'static str, found: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.to_owned(),
        expected,
        found: found.describe_type(),
    }
}

/// An integer value converted to `T`, or an error naming `key`.
fn int<T: TryFrom<i128>>(key: &str, v: &Value, expected: &'static str) -> Result<T, GgufError> {
    let i = v.as_i128().ok_or_else(|| wrong_type(key, expected, v))?;
    T::try_from(i).map_err(|_| GgufError::OutOfRange {
        key: key.to_owned(),
        value: i.to_string(),
        expected,
    })
}

fn float(key: &str, v: &Value) -> Result<f32, GgufError> {
    v.as_f64()
        .map(|f| f as f32)
        .ok_or_else(|| wrong_type(key, "number", v))
}

impl GgufHeader {
    fn get_with<'a, T>(
        &'a self,
        key: &str,
        f: impl FnOnce(&'a Value) -> Result<T, GgufError>,
    ) -> Result<Option<T>, GgufError> {
        self.get(key).map(f).transpose()
    }

    fn get_array_with<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        f: impl Fn(&'a Value) -> Result<T, GgufError>,
    ) -> Result<Option<Vec<T>>, GgufError> {
        self.get_with(key, |v| {
            let items = v.as_array().ok_or_else(|| wrong_type(key, expected, v))?;
            items
                .iter()
                .map(|item| {
                    f(item).map_err(|e| match e {
                        // Report the array's type, not the element's.
                        GgufError::WrongType { .. } => wrong_type(key, expected, v),
                        e => e,
                    })
                })
                .collect()
        })
    }

    /// Any integer type whose value fits a `u32`.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.get_with(key, |v| int(key, v, "u32"))
    }

    /// Any integer type whose value fits a `u64` (i.e. is non-negative).
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.get_with(key, |v| int(key, v, "u64"))
    }

    /// Any integer type whose value fits an `i64`.
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>, GgufError> {
        self.get_with(key, |v| int(key, v, "i64"))
    }

    /// `f32`, `f64` (rounded) or any integer type.
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.get_with(key, |v| float(key, v))
    }

    /// A `bool` value (integers are not accepted).
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.get_with(key, |v| {
            v.as_bool().ok_or_else(|| wrong_type(key, "bool", v))
        })
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.get_with(key, |v| {
            v.as_str().ok_or_else(|| wrong_type(key, "string", v))
        })
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>, GgufError> {
        self.get_array_with(key, "array<string>", |item| {
            item.as_str()
                .ok_or_else(|| wrong_type(key, "array<string>", item))
        })
    }

    /// An array of integers, each fitting an `i32`.
    pub fn get_i32_array(&self, key: &str) -> Result<Option<Vec<i32>>, GgufError> {
        self.get_array_with(key, "array<i32>", |item| int(key, item, "i32"))
    }

    /// An array of integers, each fitting a `u32`.
    pub fn get_u32_array(&self, key: &str) -> Result<Option<Vec<u32>>, GgufError> {
        self.get_array_with(key, "array<u32>", |item| int(key, item, "u32"))
    }

    /// An array of numbers (floats or integers), as `f32`.
    pub fn get_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>, GgufError> {
        self.get_array_with(key, "array<f32>", |item| float(key, item))
    }
}
