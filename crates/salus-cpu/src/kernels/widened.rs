//! f16 and bf16 2-d convolutions and their backward through the typed f32 kernel
//! (`fast::conv`): the operands widened to f32 (exactly) in the node's scratch, the f32
//! kernel run over them, its results rounded to the 16-bit type as `store` rounds. So a
//! 16-bit convolution accumulates in f32, as PyTorch's CPU kernels do, at the f32 kernel's
//! speed. The scratch's layout is `salus_graph::plan::widened_conv_bytes`'s: each present
//! input, then each used output, in f32, then the f32 kernel's own scratch. A program
//! planned with less scratch for the node (by another device's sizer) runs the generic
//! loops instead. Besides the arena, a node allocates only its f32 argument descriptions
//! (shapes), as the generic paths do.

use salus_graph::plan::widened_conv_bytes;
use salus_graph::{DType, Op, OpParams, TensorType};

use super::{Arg, Out, Result, fast, load, numel, store};

/// Runs a 16-bit convolution node with the f32 kernel (`None`: not one it takes).
pub(super) fn run(
    op: Op,
    params: &OpParams,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
    scratch: &mut [u8],
) -> Option<Result<()>> {
    let OpParams::Conv(conv) = params else {
        return None;
    };
    let mut inputs: Vec<Option<(&TensorType, &[u8])>> = Vec::with_capacity(args.len());
    for arg in args {
        inputs.push(match arg {
            Arg::Tensor(ty, bytes) => Some((*ty, *bytes)),
            Arg::Absent => None,
            Arg::InOutput(_) => return None, // convolutions never run in place
        });
    }
    let input_types: Vec<Option<&TensorType>> = inputs.iter().map(|i| i.map(|i| i.0)).collect();
    let output_types: Vec<Option<&TensorType>> =
        outs.iter().map(|o| o.as_ref().map(|o| o.ty)).collect();
    let need = widened_conv_bytes(op, conv, &input_types, &output_types)? as usize;
    let scratch: &mut [f32] = bytemuck::try_cast_slice_mut(scratch.get_mut(..need)?).ok()?;
    let wide = |ty: &TensorType| TensorType::new(DType::F32, ty.shape.clone());
    let wide_inputs: Vec<Option<TensorType>> = input_types.iter().map(|t| t.map(wide)).collect();
    let wide_outputs: Vec<Option<TensorType>> = output_types.iter().map(|t| t.map(wide)).collect();

    let mut rest = scratch;
    let mut f32_args: Vec<Arg<'_>> = Vec::with_capacity(inputs.len());
    for (input, ty) in inputs.iter().zip(&wide_inputs) {
        let (Some((half_ty, bytes)), Some(ty)) = (input, ty) else {
            f32_args.push(Arg::Absent);
            continue;
        };
        let (buf, tail) = std::mem::take(&mut rest).split_at_mut(numel(&ty.shape));
        for (i, v) in buf.iter_mut().enumerate() {
            *v = load(bytes, half_ty.dtype, i) as f32;
        }
        rest = tail;
        f32_args.push(Arg::Tensor(ty, bytemuck::cast_slice(buf)));
    }
    let mut f32_outs: Vec<Option<Out<'_>>> = Vec::with_capacity(wide_outputs.len());
    for ty in &wide_outputs {
        f32_outs.push(ty.as_ref().map(|ty| {
            let (buf, tail) = std::mem::take(&mut rest).split_at_mut(numel(&ty.shape));
            rest = tail;
            Out {
                ty,
                bytes: bytemuck::cast_slice_mut(buf),
            }
        }));
    }
    if let Err(e) = fast::run(
        op,
        params,
        &f32_args,
        &mut f32_outs,
        bytemuck::cast_slice_mut(rest),
    )? {
        return Some(Err(e));
    }
    for (out, wide) in outs.iter_mut().zip(&f32_outs) {
        if let (Some(out), Some(wide)) = (out, wide) {
            let values: &[f32] = bytemuck::cast_slice(&*wide.bytes);
            for (i, &v) in values.iter().enumerate() {
                store(out.bytes, out.ty.dtype, i, f64::from(v));
            }
        }
    }
    Some(Ok(()))
}
