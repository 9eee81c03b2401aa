//! 2-d pooling over the last two dims: max (with indices) and average from
//! [`PoolParams`], adaptive average from the shapes; reflection padding of the same dims.

use salus_graph::{Node, Op, PoolParams};

use super::{Lowered, Lowering, Operand, address, numel};
use crate::abi::{Kernel, PoolArgs};

/// Planes, h, w of a pooled `[.., h, w]` tensor (the adaptive pools' geometry).
fn plane_geometry(t: &Operand) -> Result<(u64, u64, u64), String> {
    let rank = t.ty.rank();
    if rank != 3 && rank != 4 {
        return Err(format!("pooling needs a 3-d or 4-d tensor, got {}", t.ty));
    }
    Ok((
        numel(&t.shape()[..rank - 2]),
        t.shape()[rank - 2],
        t.shape()[rank - 1],
    ))
}

/// The pooling kernels' geometry: planes, input (h, w) and output (oh, ow).
struct Geometry {
    planes: u64,
    input: [u64; 2],
    output: [u64; 2],
}

impl Geometry {
    fn of(pool: &PoolParams) -> Geometry {
        Geometry {
            planes: pool.planes,
            input: pool.input,
            output: pool.output,
        }
    }

    fn outputs(&self) -> u64 {
        self.planes * self.output[0] * self.output[1]
    }

    /// The arguments with a unit window and no operands.
    fn args(&self, err: u64, node: usize) -> PoolArgs {
        let i = |v: u64| v as i64;
        PoolArgs {
            planes: i(self.planes),
            h: i(self.input[0]),
            w: i(self.input[1]),
            oh: i(self.output[0]),
            ow: i(self.output[1]),
            k: [1, 1],
            s: [1, 1],
            p: [1, 1],
            d: [1, 1],
            err,
            node: node as i64,
            ..PoolArgs::default()
        }
    }
}

/// A window pair as the kernels' signed values.
fn pair(v: [u64; 2]) -> [i64; 2] {
    [v[0] as i64, v[1] as i64]
}

impl Lowering<'_> {
    pub(super) fn max_pool(&mut self, node: &Node) -> Lowered {
        let Some(pool) = self.params().pool() else {
            return Err("max_pool2d_with_indices without its pooling parameters".into());
        };
        let x = self.need(node, 0)?;
        let (y, idx) = (self.output(node, 0), self.output(node, 1));
        if y.is_none() && idx.is_none() {
            return Err("both outputs are unused".into());
        }
        let geometry = Geometry::of(pool);
        let mut args = geometry.args(self.err, self.index);
        (args.k, args.s) = (pair(pool.kernel), pair(pool.stride));
        (args.p, args.d) = (pair(pool.padding), pair(pool.dilation));
        (args.x, args.xdt) = (x.ptr, x.dt());
        (args.y, args.ydt) = address(y.as_ref());
        (args.idx, args.idt) = address(idx.as_ref());
        self.launch(Kernel::MaxPoolForward, geometry.outputs(), args);
        Ok(())
    }

    pub(super) fn max_pool_backward(
        &mut self,
        node: &Node,
        pool: &PoolParams,
        o: &Operand,
    ) -> Lowered {
        let (g, idx) = (self.need(node, 0)?, self.need(node, 2)?);
        if idx.shape() != g.shape() {
            return Err(format!(
                "indices {} must have the shape of grad_output {}",
                idx.ty, g.ty
            ));
        }
        if !idx.ty.dtype.is_int() {
            return Err("pooling index must be an integer tensor".into());
        }
        self.zero(o);
        let geometry = Geometry::of(pool);
        let mut args = geometry.args(self.err, self.index);
        (args.x, args.xdt) = (o.ptr, o.dt());
        (args.idx, args.idt) = (idx.ptr, idx.dt());
        (args.g, args.gdt) = (g.ptr, g.dt());
        self.launch(Kernel::MaxPoolBackward, geometry.outputs(), args);
        Ok(())
    }

    /// `avg_pool2d` and its backward (with `pool`), `_adaptive_avg_pool2d` and its
    /// backward (without).
    pub(super) fn avg_pool(
        &mut self,
        node: &Node,
        pool: Option<&PoolParams>,
        o: &Operand,
    ) -> Lowered {
        use Op::*;
        let backward = matches!(node.op, AvgPool2dBackward | AdaptiveAvgPool2dBackward);
        let (g, x) = if backward {
            (Some(self.need(node, 0)?), self.need(node, 1)?)
        } else {
            (None, self.need(node, 0)?)
        };
        let geometry = match pool {
            Some(pool) => Geometry::of(pool),
            None => {
                let (planes, h, w) = plane_geometry(&x)?;
                let (_, oh, ow) = plane_geometry(g.as_ref().unwrap_or(o))?;
                Geometry {
                    planes,
                    input: [h, w],
                    output: [oh, ow],
                }
            }
        };
        let mut args = geometry.args(self.err, self.index);
        args.count_include_pad = 1;
        if let Some(pool) = pool {
            (args.k, args.s) = (pair(pool.kernel), pair(pool.stride));
            args.p = pair(pool.padding);
            args.count_include_pad = i64::from(pool.count_include_pad);
            args.divisor = pool.divisor_override.unwrap_or(0);
        }
        match &g {
            Some(g) => {
                (args.x, args.xdt) = (o.ptr, o.dt());
                (args.g, args.gdt) = (g.ptr, g.dt());
                self.zero(o);
            }
            None => {
                (args.x, args.xdt) = (x.ptr, x.dt());
                (args.y, args.ydt) = (o.ptr, o.dt());
            }
        }
        let kernel = match node.op {
            AvgPool2d => Kernel::AvgPoolForward,
            AvgPool2dBackward => Kernel::AvgPoolBackward,
            AdaptiveAvgPool2d => Kernel::AdaptivePoolForward,
            _ => Kernel::AdaptivePoolBackward,
        };
        self.launch(kernel, geometry.outputs(), args);
        Ok(())
    }

    /// `reflection_pad2d` (into `o`) and its backward (`o` the input's gradient), with
    /// `padding` (left, right, top, bottom) of `planes` planes `input` -> `output`.
    pub(super) fn reflection_pad(
        &mut self,
        node: &Node,
        padding: [u64; 4],
        planes: u64,
        input: [u64; 2],
        output: [u64; 2],
        o: &Operand,
    ) -> Lowered {
        let geometry = Geometry {
            planes,
            input,
            output,
        };
        let mut args = geometry.args(self.err, self.index);
        args.p = [padding[2] as i64, padding[0] as i64];
        if node.op == Op::ReflectionPad2d {
            let x = self.need(node, 0)?;
            if x.ty.dtype != o.ty.dtype {
                return Err(format!(
                    "input {} and output {} differ in dtype",
                    x.ty, o.ty
                ));
            }
            (args.x, args.xdt) = (x.ptr, x.dt());
            (args.y, args.ydt) = (o.ptr, o.dt());
            self.launch(Kernel::ReflectionPadForward, geometry.outputs(), args);
        } else {
            let g = self.need(node, 0)?;
            (args.g, args.gdt) = (g.ptr, g.dt());
            (args.x, args.xdt) = (o.ptr, o.dt());
            let inputs = planes * input[0] * input[1];
            self.launch(Kernel::ReflectionPadBackward, inputs, args);
        }
        Ok(())
    }
}
