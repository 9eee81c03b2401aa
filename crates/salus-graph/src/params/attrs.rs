//! A node's inputs and attributes as [`super::extract`] reads them: tensor inputs by
//! position, attributes by schema name with the type each must have.

use std::collections::BTreeMap;

use super::Scalar;
use crate::error::{preview, preview_str};
use crate::ir::{Attr, DType, TensorType};

type Result<T> = std::result::Result<T, String>;

/// A node's tensor inputs' types, as validation found them.
pub(crate) struct Inputs<'a> {
    types: &'a [Option<TensorType>],
}

impl<'a> Inputs<'a> {
    pub(crate) fn new(types: &'a [Option<TensorType>]) -> Self {
        Inputs { types }
    }

    /// Fails unless there are exactly `n` inputs.
    pub(crate) fn count(&self, n: usize) -> Result<()> {
        if self.types.len() != n {
            return Err(format!("takes {n} tensor inputs, got {}", self.types.len()));
        }
        Ok(())
    }

    /// Input `i`, which must be present.
    pub(crate) fn input(&self, i: usize) -> Result<&'a TensorType> {
        match self.types.get(i) {
            Some(Some(t)) => Ok(t),
            Some(None) => Err(format!("input {i} is required but absent")),
            None => Err(format!("input {i} is missing ({} given)", self.types.len())),
        }
    }

    /// Input `i` when present.
    pub(crate) fn optional(&self, i: usize) -> Option<&'a TensorType> {
        self.types.get(i).and_then(Option::as_ref)
    }
}

/// An attribute's value as an error shows it: its kind and a preview of its content.
pub(super) fn describe(attr: &Attr) -> String {
    match attr {
        Attr::Str(v) => format!("Str({})", preview_str(v)),
        Attr::Ints(v) => format!("Ints({})", preview(v)),
        Attr::Floats(v) => format!("Floats({})", preview(v)),
        Attr::Bools(v) => format!("Bools({})", preview(v)),
        other => format!("{other:?}"),
    }
}

/// A node's attributes, read by schema name with the type each must have.
pub(super) struct Attrs<'a>(pub(super) &'a BTreeMap<String, Attr>);

impl<'a> Attrs<'a> {
    pub(super) fn get(&self, name: &str) -> Option<&'a Attr> {
        self.0.get(name)
    }

    pub(super) fn int(&self, name: &str) -> Result<i64> {
        match self.get(name) {
            Some(Attr::Int(v)) => Ok(*v),
            Some(other) => Err(format!(
                "attribute {name:?} must be an int, got {}",
                describe(other)
            )),
            None => Err(format!("attribute {name:?} is missing")),
        }
    }

    /// An int, `None` when absent.
    pub(super) fn int_opt(&self, name: &str) -> Result<Option<i64>> {
        match self.get(name) {
            None => Ok(None),
            Some(_) => self.int(name).map(Some),
        }
    }

    pub(super) fn int_or(&self, name: &str, default: i64) -> Result<i64> {
        match self.get(name) {
            None => Ok(default),
            Some(_) => self.int(name),
        }
    }

    pub(super) fn ints(&self, name: &str) -> Result<&'a [i64]> {
        match self.get(name) {
            Some(Attr::Ints(v)) => Ok(v),
            Some(other) => Err(format!(
                "attribute {name:?} must be a list of ints, got {}",
                describe(other)
            )),
            None => Err(format!("attribute {name:?} is missing")),
        }
    }

    /// A list of ints, empty when absent.
    pub(super) fn ints_or_empty(&self, name: &str) -> Result<&'a [i64]> {
        match self.get(name) {
            None => Ok(&[]),
            Some(_) => self.ints(name),
        }
    }

    pub(super) fn ints_opt(&self, name: &str) -> Result<Option<&'a [i64]>> {
        match self.get(name) {
            None => Ok(None),
            Some(_) => self.ints(name).map(Some),
        }
    }

    pub(super) fn bool_or(&self, name: &str, default: bool) -> Result<bool> {
        match self.get(name) {
            None => Ok(default),
            Some(Attr::Bool(v)) => Ok(*v),
            Some(other) => Err(format!(
                "attribute {name:?} must be a bool, got {}",
                describe(other)
            )),
        }
    }

    pub(super) fn bools(&self, name: &str) -> Result<&'a [bool]> {
        match self.get(name) {
            Some(Attr::Bools(v)) => Ok(v),
            Some(other) => Err(format!(
                "attribute {name:?} must be a list of bools, got {}",
                describe(other)
            )),
            None => Err(format!("attribute {name:?} is missing")),
        }
    }

    /// A number argument (ATen `Scalar`): int, float or bool.
    pub(super) fn scalar(&self, name: &str) -> Result<Scalar> {
        match self.get(name) {
            Some(Attr::Int(v)) => Ok(Scalar::Int(*v)),
            Some(Attr::Float(v)) => Ok(Scalar::Float(*v)),
            Some(Attr::Bool(v)) => Ok(Scalar::Bool(*v)),
            Some(other) => Err(format!(
                "attribute {name:?} must be a number, got {}",
                describe(other)
            )),
            None => Err(format!("attribute {name:?} is missing")),
        }
    }

    pub(super) fn scalar_opt(&self, name: &str) -> Result<Option<Scalar>> {
        match self.get(name) {
            None => Ok(None),
            Some(_) => self.scalar(name).map(Some),
        }
    }

    /// A number as f64, `default` when absent.
    pub(super) fn number_or(&self, name: &str, default: f64) -> Result<f64> {
        Ok(self.scalar_opt(name)?.map_or(default, Scalar::as_f64))
    }

    pub(super) fn dtype_opt(&self, name: &str) -> Result<Option<DType>> {
        match self.get(name) {
            None => Ok(None),
            Some(Attr::DType(d)) => Ok(Some(*d)),
            Some(other) => Err(format!(
                "attribute {name:?} must be a dtype, got {}",
                describe(other)
            )),
        }
    }

    /// The length of tensor list argument `name` (attribute `name.len`).
    pub(super) fn list_len(&self, name: &str) -> Result<usize> {
        let key = format!("{name}.len");
        match self.get(&key) {
            Some(Attr::Int(n)) if *n >= 0 => Ok(*n as usize),
            Some(other) => Err(format!(
                "attribute {key:?} must be a count, got {}",
                describe(other)
            )),
            None => Err(format!(
                "attribute {key:?} (length of tensor list {name}) is missing"
            )),
        }
    }
}
