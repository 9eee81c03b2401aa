//! Matrix products: cuBLAS for f32, f16 and bf16, a naive kernel for the other dtypes.

use salus_graph::{DType, Node, Op};

use super::{Command, Lowered, Lowering, Operand, broadcast};
use crate::abi::{ElementwiseOp, Kernel, MatmulArgs};
use crate::driver::{Gemm, GemmType};

/// One row-major operand of a product: address, row stride (leading dimension) and
/// stride between the matrices of a batch, in elements; `trans`: the product reads the
/// stored matrices transposed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Matrix {
    pub ptr: u64,
    pub ld: u64,
    pub batch_stride: i64,
    pub trans: bool,
}

impl Matrix {
    /// Matrices of `rows` rows of `ld` elements at `ptr`, one after another, read as
    /// stored.
    pub(super) fn batched(ptr: u64, ld: u64, rows: u64) -> Matrix {
        Matrix {
            ptr,
            ld,
            batch_stride: (rows * ld) as i64,
            trans: false,
        }
    }

    /// The same matrices, read transposed.
    pub(super) fn t(self) -> Matrix {
        Matrix {
            trans: true,
            ..self
        }
    }
}

/// The cuBLAS element type of operands that all share one dtype cuBLAS takes.
fn gemm_type(tys: &[&Operand]) -> Option<GemmType> {
    let d = tys.first()?.ty.dtype;
    if tys.iter().any(|t| t.ty.dtype != d) {
        return None;
    }
    match d {
        DType::F32 => Some(GemmType::F32),
        DType::F16 => Some(GemmType::F16),
        DType::Bf16 => Some(GemmType::Bf16),
        _ => None,
    }
}

impl Lowering<'_> {
    /// Whether the node's f32 products may use TF32: a convolution's (its im2col products)
    /// as the job allowed for convolutions, any other's as it allowed for matrix products.
    pub(super) fn tf32(&self) -> bool {
        let precision = self.program.graph().precision;
        match self.program.graph().nodes[self.index].op {
            salus_graph::Op::Convolution | salus_graph::Op::ConvolutionBackward => {
                precision.conv_tf32
            }
            _ => precision.matmul_tf32,
        }
    }

    /// `c[b] = alpha * op(a[b]) (n x k) @ op(bm[b]) (k x m) + beta * c[b]`, row-major (op:
    /// transposed where the operand says so), through cuBLAS (column-major: c^T = op(bm)^T
    /// op(a)^T, so bm comes first).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_row_major(
        &mut self,
        ty: GemmType,
        (n, k, m): (u64, u64, u64),
        a: Matrix,
        bm: Matrix,
        c: Matrix,
        alpha: f64,
        beta: f64,
        batch: u64,
    ) {
        if n == 0 || m == 0 || batch == 0 {
            return;
        }
        let tf32 = self.tf32();
        self.commands.push(Command::Gemm(Gemm {
            ty,
            tf32,
            trans_a: bm.trans,
            trans_b: a.trans,
            m: m as i32,
            n: n as i32,
            k: k as i32,
            alpha: alpha as f32,
            a: bm.ptr,
            lda: bm.ld as i32,
            stride_a: bm.batch_stride,
            b: a.ptr,
            ldb: a.ld as i32,
            stride_b: a.batch_stride,
            beta: beta as f32,
            c: c.ptr,
            ldc: c.ld as i32,
            stride_c: c.batch_stride,
            batch: batch as i32,
        }));
    }

    /// `mm`, `bmm` and `addmm` (`beta * self + alpha * mat1 @ mat2`).
    pub(super) fn matmul(&mut self, node: &Node, alpha: f64, beta: f64, o: &Operand) -> Lowered {
        let (a, b, bias) = match node.op {
            Op::Addmm => (
                self.need(node, 1)?,
                self.need(node, 2)?,
                Some(self.need(node, 0)?),
            ),
            _ => (self.need(node, 0)?, self.need(node, 1)?, None),
        };
        let batched = node.op == Op::Bmm;
        let sh = |t: &Operand, k: usize| -> Result<u64, String> {
            t.shape()
                .get(k)
                .copied()
                .ok_or_else(|| format!("{} has too few dims for {}", t.ty, node.op))
        };
        let (batch, n, k, m) = if batched {
            (sh(&a, 0)?, sh(&a, 1)?, sh(&a, 2)?, sh(&b, 2)?)
        } else {
            (1, sh(&a, 0)?, sh(&a, 1)?, sh(&b, 1)?)
        };
        // A factor that is a folded transpose (`folds`) is read from its source.
        let slots = if node.op == Op::Addmm { [1, 2] } else { [0, 1] };
        let folded = slots.map(|k| {
            node.inputs[k]
                .and_then(|t| self.folds.source(t))
                .map(|(s, transposed)| (self.operand(s), transposed))
        });
        let factor =
            |t: &Operand, folded: &Option<(Operand, bool)>, rows: u64, cols: u64| match folded {
                Some((s, true)) => Matrix::batched(s.ptr, rows, cols).t(),
                Some((s, false)) => Matrix::batched(s.ptr, cols, rows),
                None => Matrix::batched(t.ptr, cols, rows),
            };
        if let (Some(ty), true) = (gemm_type(&[&a, &b, o]), k > 0) {
            // With an epilogue (`epilogues`) the product writes its add's output, starting
            // from the add's other operand.
            let epilogue = self.epilogues.of(self.index);
            let target = epilogue.map_or_else(|| o.clone(), |e| self.operand(e.out));
            let residual = epilogue.map(|e| self.operand(e.residual));
            let mut acc = 0.0;
            match (&bias, &residual) {
                (Some(bias), Some(r)) => {
                    self.ew(ElementwiseOp::Add, &target, &[r, bias], [beta, 0.0, 0.0])?;
                    acc = 1.0;
                }
                (Some(bias), None) => {
                    self.ew(ElementwiseOp::MulScalar, &target, &[bias], [beta, 0.0, 0.0])?;
                    acc = 1.0;
                }
                (None, Some(r)) => {
                    if r.ptr != target.ptr {
                        self.copy_flat(&target, r)?;
                    }
                    acc = 1.0;
                }
                (None, None) => {}
            }
            self.gemm_row_major(
                ty,
                (n, k, m),
                factor(&a, &folded[0], n, k),
                factor(&b, &folded[1], k, m),
                Matrix::batched(target.ptr, m, n),
                alpha,
                acc,
                batch,
            );
            return Ok(());
        }
        if self.epilogues.of(self.index).is_some() {
            return Err("internal: an add was folded into a product cuBLAS does not run".into());
        }
        if folded.iter().any(Option::is_some) {
            return Err(
                "internal: a transpose was folded into a product cuBLAS does not run".into(),
            );
        }
        let mut args = MatmulArgs {
            batch: batch as i64,
            n: n as i64,
            k: k as i64,
            m: m as i64,
            alpha,
            beta,
            a: a.ptr,
            adt: a.dt(),
            b: b.ptr,
            bdt: b.dt(),
            c: o.ptr,
            cdt: o.dt(),
            ..MatmulArgs::default()
        };
        if let Some(t) = &bias {
            let st = broadcast(t.shape(), o.shape());
            (args.bias, args.biasdt) = (t.ptr, t.dt());
            args.bias_s0 = st.first().copied().unwrap_or(0);
            args.bias_s1 = st.get(1).copied().unwrap_or(0);
        }
        self.launch(Kernel::MatmulNaive, batch * n * m, args);
        Ok(())
    }
}
