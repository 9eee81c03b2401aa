//! Convolution and pooling geometry: attributes expanded to every spatial dimension and
//! checked, output sizes derived, once.

use crate::ir::TensorType;

type Result<T> = std::result::Result<T, String>;

/// A convolution's attributes and geometry (`convolution` and `convolution_backward`, 1 to
/// 3 spatial dimensions). Per-dimension lists have one entry per spatial dimension, a
/// single attribute value having been repeated for each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvParams {
    /// `stride` (required, each > 0).
    pub stride: Vec<u64>,
    /// `padding` (empty: 0).
    pub padding: Vec<u64>,
    /// `dilation` (empty: 1; each > 0).
    pub dilation: Vec<u64>,
    /// `transposed` (default false).
    pub transposed: bool,
    /// `output_padding` (absent or empty: 0).
    pub output_padding: Vec<u64>,
    /// `groups` (required, > 0).
    pub groups: u64,
    /// `output_mask` of `convolution_backward` (3 bools: grad_input, grad_weight,
    /// grad_bias); all true for `convolution`. `bias_sizes` is not kept: the bias gradient
    /// is always `[out_channels]`.
    pub output_mask: [bool; 3],
    /// N: the input's first dimension.
    pub batch: u64,
    /// C_in: the input's channels.
    pub in_channels: u64,
    /// C_out: the output's channels (`weight[0]`, or `weight[1] * groups` transposed).
    pub out_channels: u64,
    /// The input's spatial sizes.
    pub input: Vec<u64>,
    /// The kernel's spatial sizes (the weight's dimensions after the first two).
    pub kernel: Vec<u64>,
    /// The output's spatial sizes: `floor((in + 2p - d(k-1) - 1) / s) + 1`, or transposed
    /// `(in - 1)s - 2p + d(k-1) + output_padding + 1`.
    pub output: Vec<u64>,
}

impl ConvParams {
    /// Number of spatial dimensions (1 to 3).
    pub fn spatial_dims(&self) -> usize {
        self.input.len()
    }

    /// Input channels of one group.
    pub fn in_per_group(&self) -> u64 {
        self.in_channels / self.groups
    }

    /// Output channels of one group.
    pub fn out_per_group(&self) -> u64 {
        self.out_channels / self.groups
    }

    /// The output's full shape: `[N, C_out, *output]`.
    pub fn output_shape(&self) -> Vec<u64> {
        let mut shape = vec![self.batch, self.out_channels];
        shape.extend(&self.output);
        shape
    }

    /// True when the kernel is all 1s, the stride 1 and the padding 0: the input is its own
    /// unfolded matrix.
    pub fn is_pointwise(&self) -> bool {
        self.kernel.iter().all(|&k| k == 1)
            && self.stride.iter().all(|&s| s == 1)
            && self.padding.iter().all(|&p| p == 0)
    }

    /// For 2 spatial dimensions, not transposed, `(k, l, direct)`: the unfolded input of
    /// one image and group is `k x l` (`k = C_in/groups * kh * kw`, `l = oh * ow`) and
    /// `direct` convolutions ([`ConvParams::is_pointwise`]) use the input as it is. `None`
    /// for other ranks and for transposed convolutions (their kernels unfold nothing).
    /// What the planner's scratch and the kernels agree on.
    pub fn unfold_2d(&self) -> Option<(u64, u64, bool)> {
        if self.spatial_dims() != 2 || self.transposed {
            return None;
        }
        let k = self.in_per_group() * self.kernel[0] * self.kernel[1];
        let l = self.output[0] * self.output[1];
        Some((k, l, self.is_pointwise()))
    }

    /// For a transposed convolution, the convolution whose input gradient it computes
    /// (its adjoint): input and output swapped (sizes and channels), the same weight,
    /// stride, padding, dilation and groups. `None` when not transposed, or when an output
    /// padding reaches its stride (the adjoint's output would then be another size).
    pub fn adjoint(&self) -> Option<ConvParams> {
        if !self.transposed
            || self
                .output_padding
                .iter()
                .zip(&self.stride)
                .any(|(&op, &s)| op >= s)
        {
            return None;
        }
        Some(ConvParams {
            transposed: false,
            output_padding: vec![0; self.spatial_dims()],
            in_channels: self.out_channels,
            out_channels: self.in_channels,
            input: self.output.clone(),
            output: self.input.clone(),
            ..self.clone()
        })
    }

    /// Images whose unfolded inputs one matrix product of the CPU's 2-d kernel takes side
    /// by side: 1 when one image's output plane has [`FOLD_COLUMNS`] positions or more,
    /// else as many as make that many columns, at most the batch. A product one column
    /// per image (a 1x1 output plane, or a weight gradient written as a convolution, whose
    /// "images" are channels) would otherwise be a matrix-vector product, bound by memory.
    pub fn fold(&self) -> u64 {
        let l: u64 = self.output.iter().product();
        if l == 0 || l >= FOLD_COLUMNS {
            1
        } else {
            FOLD_COLUMNS.div_ceil(l).min(self.batch).max(1)
        }
    }
}

/// The fewest columns (output positions) a convolution's matrix product is given when
/// images can be put side by side ([`ConvParams::fold`]).
pub const FOLD_COLUMNS: u64 = 256;

/// A 2-d pooling window (`max_pool2d_with_indices`, `avg_pool2d` and their backwards) and
/// its geometry over the input's last two dimensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolParams {
    /// `kernel_size` (one value for both dimensions, or two; each > 0).
    pub kernel: [u64; 2],
    /// `stride` (absent or empty: the kernel; each > 0).
    pub stride: [u64; 2],
    /// `padding` (default 0; at most half the kernel).
    pub padding: [u64; 2],
    /// `dilation` of the max pool (default 1); 1 for the average pool, which has none.
    pub dilation: [u64; 2],
    /// `ceil_mode` (default false): round the output size up, though no window may start
    /// inside the right padding.
    pub ceil_mode: bool,
    /// `count_include_pad` of the average pool (default true): the divisor counts padding
    /// inside the padded input. True for the max pool.
    pub count_include_pad: bool,
    /// `divisor_override` of the average pool (absent: none; never 0).
    pub divisor_override: Option<i64>,
    /// Planes: the product of the input's leading dimensions (N * C, or C for 3-d input).
    pub planes: u64,
    /// The input's last two dimensions.
    pub input: [u64; 2],
    /// The output's last two dimensions.
    pub output: [u64; 2],
}

/// `values` for `n` spatial dimensions: one value stands for all, empty takes `default`.
pub(crate) fn spatial(
    values: &[i64],
    n: usize,
    what: &str,
    default: Option<i64>,
) -> Result<Vec<i64>> {
    match values.len() {
        0 => default
            .map(|d| vec![d; n])
            .ok_or_else(|| format!("{what} is empty")),
        1 => Ok(vec![values[0]; n]),
        len if len == n => Ok(values.to_vec()),
        len => Err(format!(
            "{what} has {len} values for {n} spatial dimensions"
        )),
    }
}

/// The attributes of a convolution, before they meet the operand shapes.
pub(crate) struct ConvAttrs<'a> {
    pub stride: &'a [i64],
    pub padding: &'a [i64],
    pub dilation: &'a [i64],
    pub transposed: bool,
    pub output_padding: &'a [i64],
    pub groups: i64,
    pub output_mask: [bool; 3],
}

/// Checks a convolution's attributes against its input and weight and derives its geometry.
pub(crate) fn conv(
    a: &ConvAttrs<'_>,
    input: &TensorType,
    weight: &TensorType,
) -> Result<ConvParams> {
    let rank = input.rank();
    if rank < 3 || weight.rank() != rank {
        return Err(format!(
            "input {input} and weight {weight} must both be 3-d to 5-d and of equal rank"
        ));
    }
    let n = rank - 2;
    let stride = spatial(a.stride, n, "stride", None)?;
    let padding = spatial(a.padding, n, "padding", Some(0))?;
    let dilation = spatial(a.dilation, n, "dilation", Some(1))?;
    let output_padding = spatial(a.output_padding, n, "output_padding", Some(0))?;
    let groups = a.groups;
    if groups <= 0 {
        return Err(format!("groups must be positive, got {groups}"));
    }
    let groups = groups as u64;
    let transposed = a.transposed;
    let (c_in, c_out) = if transposed {
        (weight.shape[0], weight.shape[1] * groups)
    } else {
        (weight.shape[1] * groups, weight.shape[0])
    };
    if input.shape[1] != c_in {
        return Err(format!(
            "input has {} channels but weight {weight} with groups {groups} expects {c_in}",
            input.shape[1]
        ));
    }
    if !transposed && c_out % groups != 0 {
        return Err(format!(
            "{c_out} output channels do not split into {groups} groups"
        ));
    }
    let mut output = Vec::with_capacity(n);
    for i in 0..n {
        let size = input.shape[2 + i] as i64;
        let k = weight.shape[2 + i] as i64;
        let (s, p, d, op) = (stride[i], padding[i], dilation[i], output_padding[i]);
        if s <= 0 || d <= 0 || p < 0 || op < 0 {
            return Err(format!(
                "stride {s} and dilation {d} must be positive, padding {p} and output_padding {op} >= 0"
            ));
        }
        let out = if transposed {
            (size - 1) * s - 2 * p + d * (k - 1) + op + 1
        } else {
            (size + 2 * p - d * (k - 1) - 1) / s + 1
        };
        if out <= 0 || (!transposed && size + 2 * p < d * (k - 1) + 1) {
            return Err(format!(
                "spatial dimension {i}: input {size} with padding {p} is smaller than the kernel extent {}",
                d * (k - 1) + 1
            ));
        }
        output.push(out as u64);
    }
    let unsigned = |v: Vec<i64>| v.into_iter().map(|x| x as u64).collect();
    Ok(ConvParams {
        stride: unsigned(stride),
        padding: unsigned(padding),
        dilation: unsigned(dilation),
        transposed,
        output_padding: unsigned(output_padding),
        groups,
        output_mask: a.output_mask,
        batch: input.shape[0],
        in_channels: c_in,
        out_channels: c_out,
        input: input.shape[2..].to_vec(),
        kernel: weight.shape[2..].to_vec(),
        output,
    })
}

/// One output size of a pooling window.
fn pooled(size: u64, kernel: i64, stride: i64, pad: i64, dilation: i64, ceil: bool) -> Result<u64> {
    if kernel <= 0 || stride <= 0 || dilation <= 0 || pad < 0 {
        return Err(format!(
            "kernel {kernel}, stride {stride}, dilation {dilation} must be positive and padding {pad} >= 0"
        ));
    }
    if pad * 2 > kernel {
        return Err(format!(
            "padding {pad} must be at most half the kernel {kernel}"
        ));
    }
    let span = size as i64 + 2 * pad - dilation * (kernel - 1) - 1;
    if span < 0 {
        return Err(format!(
            "input size {size} with padding {pad} is smaller than the kernel extent {}",
            dilation * (kernel - 1) + 1
        ));
    }
    let mut out = if ceil {
        (span + stride - 1) / stride + 1
    } else {
        span / stride + 1
    };
    // A last window that starts inside the right padding is dropped (ATen's rule).
    if ceil && (out - 1) * stride >= size as i64 + pad {
        out -= 1;
    }
    Ok(out as u64)
}

/// The attributes of a pooling, before they meet the input's shape.
pub(crate) struct PoolAttrs<'a> {
    pub kernel_size: &'a [i64],
    pub stride: &'a [i64],
    pub padding: &'a [i64],
    pub dilation: &'a [i64],
    pub ceil_mode: bool,
    pub count_include_pad: bool,
    pub divisor_override: Option<i64>,
}

/// Checks a 2-d pooling's attributes against its (3-d or 4-d) input and derives its output.
pub(crate) fn pool(a: &PoolAttrs<'_>, input: &TensorType) -> Result<PoolParams> {
    let rank = input.rank();
    if rank != 3 && rank != 4 {
        return Err(format!("input must be 3-d or 4-d, got {input}"));
    }
    let kernel = spatial(a.kernel_size, 2, "kernel_size", None)?;
    let stride = if a.stride.is_empty() {
        kernel.clone()
    } else {
        spatial(a.stride, 2, "stride", None)?
    };
    let padding = spatial(a.padding, 2, "padding", Some(0))?;
    let dilation = spatial(a.dilation, 2, "dilation", Some(1))?;
    if a.divisor_override == Some(0) {
        return Err("divisor_override must not be 0".into());
    }
    let at = |i: usize| input.shape[rank - 2 + i];
    let mut output = [0; 2];
    for (i, out) in output.iter_mut().enumerate() {
        *out = pooled(
            at(i),
            kernel[i],
            stride[i],
            padding[i],
            dilation[i],
            a.ceil_mode,
        )?;
    }
    let pair = |v: &[i64]| [v[0] as u64, v[1] as u64];
    Ok(PoolParams {
        kernel: pair(&kernel),
        stride: pair(&stride),
        padding: pair(&padding),
        dilation: pair(&dilation),
        ceil_mode: a.ceil_mode,
        count_include_pad: a.count_include_pad,
        divisor_override: a.divisor_override,
        planes: input.shape[..rank - 2].iter().product(),
        input: [at(0), at(1)],
        output,
    })
}
