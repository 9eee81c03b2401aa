//! What a served model's programs look like row by row: the checks `Serve` makes of a
//! session's programs against its variants, batch sizes and decode loop, and the copies
//! that put request rows into a batch (zero-padded) and take answer rows out (cut back).

use std::sync::Arc;

use salus_exec::Program;
use salus_graph::{DType, Role, TensorType};

use super::{DecodeSpec, ServeSpec};

/// Most variants one served model may have.
pub const MAX_VARIANTS: usize = 16;

/// Most decode steps a request may take.
pub const MAX_STEPS: u32 = 1 << 20;

/// One variant's programs and the shapes of one request's rows in them.
#[derive(Debug, Clone)]
pub struct VariantShapes {
    /// Its name.
    pub name: String,
    /// (batch size, program number), batch sizes ascending.
    pub programs: Vec<(usize, u32)>,
    /// Each feed's row: its type without the batch dimension.
    pub feeds: Vec<TensorType>,
    /// Each fetch's row.
    pub fetches: Vec<TensorType>,
}

impl VariantShapes {
    /// The program for batches of `size` (one of the variant's sizes).
    pub fn program(&self, size: usize) -> u32 {
        self.programs
            .iter()
            .find(|(s, _)| *s == size)
            .expect("a batch size the scheduler was given")
            .1
    }
}

/// A served model, checked: its variants, cheapest first, all with the same batch sizes.
#[derive(Debug, Clone)]
pub struct Shapes {
    /// Its variants.
    pub variants: Vec<VariantShapes>,
    /// Every variant's batch sizes, ascending.
    pub batch_sizes: Vec<usize>,
    /// The feed salusd fills with each request's variant index.
    pub variant_feed: Option<usize>,
}

impl Shapes {
    /// The feeds a request of `variant` gives, by index with their row types: every feed
    /// but the variant feed, which salusd fills.
    pub fn request_feeds(&self, variant: usize) -> impl Iterator<Item = (usize, &TensorType)> {
        self.variants[variant]
            .feeds
            .iter()
            .enumerate()
            .filter(move |(f, _)| Some(*f) != self.variant_feed)
    }

    /// Checks `spec` against `programs` (the session's, by number).
    pub fn check(spec: &ServeSpec, programs: &[Arc<Program>]) -> Result<Shapes, String> {
        if spec.variants.is_empty() || spec.variants.len() > MAX_VARIANTS {
            return Err(format!(
                "a served model has 1 to {MAX_VARIANTS} variants, not {}",
                spec.variants.len()
            ));
        }
        let mut variants: Vec<VariantShapes> = Vec::with_capacity(spec.variants.len());
        for (v, variant) in spec.variants.iter().enumerate() {
            let what = format!("variant {v} ('{}')", variant.name);
            let mut sized: Vec<(usize, u32)> = variant.programs.clone();
            sized.sort_unstable();
            if sized.is_empty() || sized.windows(2).any(|w| w[0].0 == w[1].0) || sized[0].0 == 0 {
                return Err(format!(
                    "{what} needs one program for each of its batch sizes, distinct and \
                     positive: got {:?}",
                    variant.programs
                ));
            }
            let mut shapes = VariantShapes {
                name: variant.name.clone(),
                programs: Vec::with_capacity(sized.len()),
                feeds: Vec::new(),
                fetches: Vec::new(),
            };
            for &(size, number) in &sized {
                let program = programs.get(number as usize).ok_or_else(|| {
                    format!(
                        "{what}: the session has no program {number} (it holds {})",
                        programs.len()
                    )
                })?;
                let what = format!("{what}, program {number} (batch {size})");
                if !program.graph().updates.is_empty() {
                    return Err(format!(
                        "{what} updates persistent tensors; a served model's programs only \
                         read them (serve an inference session)"
                    ));
                }
                let (feeds, fetches) = rows(program, size).map_err(|e| format!("{what}: {e}"))?;
                if shapes.programs.is_empty() {
                    (shapes.feeds, shapes.fetches) = (feeds, fetches);
                } else if feeds != shapes.feeds || fetches != shapes.fetches {
                    return Err(format!(
                        "{what}: its rows ({}) are not those of the variant's batch {} ({})",
                        describe(&feeds, &fetches),
                        shapes.programs[0].0,
                        describe(&shapes.feeds, &shapes.fetches)
                    ));
                }
                shapes.programs.push((size, number));
            }
            if let Some(before) = variants.last() {
                let sizes = |s: &VariantShapes| s.programs.iter().map(|p| p.0).collect::<Vec<_>>();
                if sizes(before) != sizes(&shapes) {
                    return Err(format!(
                        "{what} has batch sizes {:?}, variant {} has {:?}: every variant needs \
                         the same",
                        sizes(&shapes),
                        v - 1,
                        sizes(before)
                    ));
                }
                if !holds(&shapes.feeds, &before.feeds) || !holds(&shapes.fetches, &before.fetches)
                {
                    return Err(format!(
                        "{what}: its rows ({}) do not hold variant {}'s ({}) in every \
                         dimension; variants go cheapest first, each at least as large as the \
                         one before",
                        describe(&shapes.feeds, &shapes.fetches),
                        v - 1,
                        describe(&before.feeds, &before.fetches)
                    ));
                }
            }
            variants.push(shapes);
        }
        if let Some(decode) = &spec.decode {
            check_decode(decode, &variants)?;
        }
        if let Some(feed) = spec.variant_feed {
            let ty = variants[0].feeds.get(feed).ok_or_else(|| {
                format!(
                    "the variant feed is feed {feed}, but the programs have {} feeds",
                    variants[0].feeds.len()
                )
            })?;
            if !ty.shape.is_empty() || !matches!(ty.dtype, DType::I64 | DType::I32) {
                return Err(format!(
                    "the variant feed (feed {feed}) must be one i64 or i32 per request (shape \
                     [batch]); it is {ty} per request"
                ));
            }
            if spec
                .decode
                .iter()
                .any(|d| d.carry.iter().any(|c| c.1 == feed))
            {
                return Err(format!(
                    "decoding carries a fetch into the variant feed {feed}"
                ));
            }
        }
        let batch_sizes = variants[0].programs.iter().map(|p| p.0).collect();
        Ok(Shapes {
            variants,
            batch_sizes,
            variant_feed: spec.variant_feed,
        })
    }
}

/// Each feed's and fetch's row type in `program`, whose batch dimension must be `size`.
fn rows(program: &Program, size: usize) -> Result<(Vec<TensorType>, Vec<TensorType>), String> {
    let graph = program.graph();
    let row = |what: String, ty: &TensorType| -> Result<TensorType, String> {
        match ty.shape.first() {
            Some(&b) if b == size as u64 => Ok(TensorType::new(ty.dtype, ty.shape[1..].to_vec())),
            _ => Err(format!(
                "{what} is {ty}, not a batch of {size} (the batch is every served feed's and \
                 fetch's first dimension)"
            )),
        }
    };
    let feeds = graph
        .tensors
        .iter()
        .filter(|t| t.role == Role::Feed)
        .map(|t| row(format!("feed '{}'", t.name), &t.ty))
        .collect::<Result<Vec<_>, _>>()?;
    let fetches = graph
        .fetches
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            let t = &graph.tensors[id];
            row(format!("fetch {i} ('{}')", t.name), &t.ty)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((feeds, fetches))
}

fn describe(feeds: &[TensorType], fetches: &[TensorType]) -> String {
    let list = |l: &[TensorType]| {
        l.iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!("feeds {}; fetches {}", list(feeds), list(fetches))
}

/// Whether every row of `large` has the dtype and rank of `small`'s and is at least as
/// large in each dimension.
fn holds(large: &[TensorType], small: &[TensorType]) -> bool {
    large.len() == small.len()
        && large.iter().zip(small).all(|(l, s)| {
            l.dtype == s.dtype
                && l.shape.len() == s.shape.len()
                && l.shape.iter().zip(&s.shape).all(|(a, b)| a >= b)
        })
}

fn check_decode(decode: &DecodeSpec, variants: &[VariantShapes]) -> Result<(), String> {
    if decode.max_steps == 0 || decode.max_steps > MAX_STEPS {
        return Err(format!(
            "decoding takes 1 to {MAX_STEPS} steps at most, not {}",
            decode.max_steps
        ));
    }
    let first = &variants[0];
    let done = first.fetches.get(decode.done).ok_or_else(|| {
        format!(
            "decoding's done flag is fetch {}, but the programs have {} fetches",
            decode.done,
            first.fetches.len()
        )
    })?;
    if !done.shape.is_empty() || matches!(done.dtype, DType::Bf16 | DType::F16) {
        return Err(format!(
            "decoding's done flag (fetch {}) must be one bool, integer or f32 value per \
             request (shape [batch]); it is {done} per request",
            decode.done
        ));
    }
    let mut carried = vec![false; first.feeds.len()];
    for &(fetch, feed) in &decode.carry {
        for v in variants {
            let (Some(from), Some(to)) = (v.fetches.get(fetch), v.feeds.get(feed)) else {
                return Err(format!(
                    "decoding carries fetch {fetch} into feed {feed}, but the programs have \
                     {} fetches and {} feeds",
                    v.fetches.len(),
                    v.feeds.len()
                ));
            };
            if from != to {
                return Err(format!(
                    "decoding carries fetch {fetch} ({from} per request) into feed {feed} \
                     ({to} per request) in variant '{}': they must be alike",
                    v.name
                ));
            }
        }
        if std::mem::replace(&mut carried[feed], true) {
            return Err(format!("decoding carries two fetches into feed {feed}"));
        }
    }
    if decode.carry.is_empty() {
        return Err(
            "decoding carries no fetch into a feed: every step would compute the same".into(),
        );
    }
    Ok(())
}

/// Bytes of one row of type `ty`.
pub fn row_bytes(ty: &TensorType) -> usize {
    ty.bytes().unwrap_or(0) as usize
}

/// Copies a row of shape `from` into `out`, a row of shape `to` at least as large in every
/// dimension, at the start of each dimension; the rest of `out` is left as it is.
pub fn pad_into(row: &[u8], from: &TensorType, to: &TensorType, out: &mut [u8]) {
    copy_block(
        row,
        &from.shape,
        out,
        &to.shape,
        &from.shape,
        from.dtype.size() as usize,
    );
}

/// The part of `row` (shape `from`) at the start of each dimension, of shape `to`.
pub fn cut(row: &[u8], from: &TensorType, to: &TensorType) -> Vec<u8> {
    if from == to {
        return row.to_vec();
    }
    let mut out = vec![0; row_bytes(to)];
    copy_block(
        row,
        &from.shape,
        &mut out,
        &to.shape,
        &to.shape,
        to.dtype.size() as usize,
    );
    out
}

/// Copies the block `extent` (the smaller of the two shapes) between `src` (shape `a`) and
/// `dst` (shape `b`), both row-major from index 0.
fn copy_block(src: &[u8], a: &[u64], dst: &mut [u8], b: &[u64], extent: &[u64], element: usize) {
    if extent.contains(&0) {
        return;
    }
    if a == b {
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
        return;
    }
    let rank = extent.len();
    if rank == 0 {
        dst[..element].copy_from_slice(&src[..element]);
        return;
    }
    let strides = |shape: &[u64]| {
        let mut s = vec![element; rank];
        for d in (0..rank - 1).rev() {
            s[d] = s[d + 1] * shape[d + 1] as usize;
        }
        s
    };
    let (sa, sb) = (strides(a), strides(b));
    let run = extent[rank - 1] as usize * element;
    let mut index = vec![0u64; rank];
    loop {
        let (mut oa, mut ob) = (0, 0);
        for d in 0..rank - 1 {
            oa += index[d] as usize * sa[d];
            ob += index[d] as usize * sb[d];
        }
        dst[ob..ob + run].copy_from_slice(&src[oa..oa + run]);
        // The next index over every dimension but the last.
        let mut d = rank - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < extent[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// A variant feed's bytes: `values` (each request's variant, then padding) as `dtype`.
pub fn variant_indices(values: &[usize], dtype: DType) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match dtype {
            DType::I32 => (v as i32).to_le_bytes().to_vec(),
            _ => (v as i64).to_le_bytes().to_vec(),
        })
        .collect()
}

/// Whether element `i` of a done flag of `dtype` (its bytes `flags`) is nonzero.
pub fn flag(flags: &[u8], dtype: DType, i: usize) -> bool {
    let n = dtype.size() as usize;
    let bytes = &flags[i * n..(i + 1) * n];
    match dtype {
        DType::F32 => f32::from_le_bytes(bytes.try_into().expect("4 bytes")) != 0.0,
        _ => bytes.iter().any(|&b| b != 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ty(shape: &[u64]) -> TensorType {
        TensorType::new(DType::I32, shape.to_vec())
    }

    fn ints(values: &[i32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn a_row_pads_at_the_end_of_each_dimension_and_cuts_back() {
        let (small, large) = (ty(&[2, 2]), ty(&[3, 4]));
        let row = ints(&[1, 2, 3, 4]);
        let mut out = vec![0; row_bytes(&large)];
        pad_into(&row, &small, &large, &mut out);
        assert_eq!(out, ints(&[1, 2, 0, 0, 3, 4, 0, 0, 0, 0, 0, 0]));
        assert_eq!(cut(&out, &large, &small), row);
        // Rank 0 and rank 1.
        let mut one = vec![0; 4];
        pad_into(&ints(&[7]), &ty(&[]), &ty(&[]), &mut one);
        assert_eq!(one, ints(&[7]));
        let mut three = vec![0; 12];
        pad_into(&ints(&[5, 6]), &ty(&[2]), &ty(&[3]), &mut three);
        assert_eq!(three, ints(&[5, 6, 0]));
        assert_eq!(cut(&three, &ty(&[3]), &ty(&[1])), ints(&[5]));
    }

    #[test]
    fn done_flags_read_each_dtype() {
        let f = [0.0f32, 2.5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<_>>();
        assert!(!flag(&f, DType::F32, 0) && flag(&f, DType::F32, 1));
        assert!(flag(&[0, 1], DType::Bool, 1) && !flag(&[0, 1], DType::Bool, 0));
        let i = ints(&[0, -3]);
        assert!(!flag(&i, DType::I32, 0) && flag(&i, DType::I32, 1));
    }
}
