//! Advanced indexing (`index.Tensor`, `index_put`): which dimensions of `self` a list of
//! index tensors indexes, and the shape of what they select, as PyTorch's indexing rules
//! give it.

use crate::infer::broadcast;
use crate::ir::{DType, TensorType};

type Result<T> = std::result::Result<T, String>;

/// How the `indices` list (`Tensor?[]`: index tensors and absent entries) of
/// `index.Tensor` and `index_put` selects elements of `self`.
///
/// The integer index tensors broadcast together to [`AdvancedIndex::index_shape`]; each
/// element of that shape picks one position in every indexed dimension. Dimensions with
/// an absent entry, and those past the end of the list, are taken whole. The selection's
/// shape ([`AdvancedIndex::shape`]) is the whole dimensions in order with the index shape
/// inserted where the first indexed dimension was when the indexed dimensions are
/// adjacent, and in front otherwise (PyTorch's rule). `x[:, :, rows, cols]` with
/// `rows: [H, 1]` and `cols: [W]` on `[N, C, h, w]` selects `[N, C, H, W]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdvancedIndex {
    /// Per dimension of `self`: `Some(k)` when entry `k` of `indices` (node input
    /// `1 + k`) indexes it, `None` when it is taken whole.
    pub dims: Vec<Option<usize>>,
    /// The index tensors' shapes broadcast together.
    pub index_shape: Vec<u64>,
    /// The selection's first dimension of `index_shape`.
    pub index_at: usize,
    /// The selection's shape: what `index.Tensor` returns and what `index_put`'s values
    /// broadcast to.
    pub shape: Vec<u64>,
}

impl AdvancedIndex {
    /// Per dimension of `self`: the selection's dimension that walks it when it is taken
    /// whole, `None` when it is indexed.
    pub fn whole_dims(&self) -> Vec<Option<usize>> {
        let mut whole = 0;
        self.dims
            .iter()
            .map(|d| match d {
                Some(_) => None,
                None => {
                    let at = if whole < self.index_at {
                        whole
                    } else {
                        whole + self.index_shape.len()
                    };
                    whole += 1;
                    Some(at)
                }
            })
            .collect()
    }
}

/// The advanced index of `t` by `indices` (`None` for absent entries). `None` when an
/// index is a bool mask: what a mask selects depends on its values, so no static shape
/// describes it.
pub(crate) fn advanced_index(
    t: &TensorType,
    indices: &[Option<&TensorType>],
) -> Result<Option<AdvancedIndex>> {
    if indices.len() > t.rank() {
        return Err(format!(
            "{} indices for a tensor of rank {}",
            indices.len(),
            t.rank()
        ));
    }
    let mut index_shape: Option<Vec<u64>> = None;
    for (k, index) in indices.iter().enumerate() {
        let Some(index) = index else { continue };
        if index.dtype == DType::Bool {
            return Ok(None);
        }
        if !index.dtype.is_int() {
            return Err(format!("index {k} must be integer or bool, got {index}"));
        }
        index_shape = Some(match index_shape {
            None => index.shape.clone(),
            Some(s) => broadcast(&s, &index.shape)
                .map_err(|e| format!("the index tensors do not broadcast together: {e}"))?,
        });
    }
    let Some(index_shape) = index_shape else {
        return Err("needs at least one index tensor".into());
    };
    let dims: Vec<Option<usize>> = (0..t.rank())
        .map(|d| indices.get(d).copied().flatten().map(|_| d))
        .collect();
    let indexed: Vec<usize> = (0..t.rank()).filter(|&d| dims[d].is_some()).collect();
    let (first, last) = (indexed[0], indexed[indexed.len() - 1]);
    let adjacent = last - first + 1 == indexed.len();
    let whole: Vec<u64> = (0..t.rank())
        .filter(|&d| dims[d].is_none())
        .map(|d| t.shape[d])
        .collect();
    let index_at = if adjacent { first } else { 0 };
    let mut shape = whole[..index_at].to_vec();
    shape.extend(&index_shape);
    shape.extend(&whole[index_at..]);
    Ok(Some(AdvancedIndex {
        dims,
        index_shape,
        index_at,
        shape,
    }))
}
