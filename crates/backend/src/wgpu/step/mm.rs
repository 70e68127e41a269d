//! The matmuls of a step: which kernel multiplies each part of a weight matrix (the GEMV for a
//! few tokens, with the RMSNorm and RoPE fused in for one; the prompt GEMM, split over columns
//! where its tiles are few, for more), and the dispatches that run it.

use super::super::gemm;
use super::super::gemv::{Gemv, GemvIn};
use super::super::kernels::{Kernels, MmShape, WType};
use super::super::weights::{DMatrix, Part};
use super::{Key, Step};
use crate::BackendError;

/// How one part of a weight matrix is multiplied.
pub enum Mm<'k> {
    /// The GEMV (at most `kernels::MM_TOKENS` tokens) and its grid.
    Gemv(&'k wgpu::ComputePipeline, [u32; 3]),
    /// The prompt GEMM through `path`, split over its columns as `split` (then its reduce
    /// follows).
    Gemm {
        path: gemm::GemmPath,
        pipe: &'k wgpu::ComputePipeline,
        split: gemm::Split,
    },
}

/// The kernel that multiplies one part of a weight matrix of type `t` for the shape `s`: the
/// GEMM (on matrix units where the device has them) once the GEMV would read the weights more
/// than once (more than `kernels::MM_TOKENS` tokens), the GEMV below that. Both read the same
/// parameters and bindings.
pub fn mm_kernel<'k>(k: &'k Kernels, t: WType, s: &MmShape) -> Mm<'k> {
    if s.n >= gemm::GEMM_MIN_TOKENS {
        let path = k.gemm.choose(t, s);
        if let Some(pipe) = k.gemm.pipe(path, t) {
            let split = path.split(t, s);
            return Mm::Gemm { path, pipe, split };
        }
    }
    let (pipe, groups) = k.gemv(t, s, false);
    Mm::Gemv(pipe, groups)
}

/// Whether shape `s` runs the one-token GEMV (its pipelines' bind groups are their own).
fn one_token_gemv(t: WType, s: &MmShape) -> bool {
    s.n == 1 && Gemv::engine(t) != Gemv::Multi
}

impl Step<'_> {
    /// `y` (+)= `x` · `w`ᵀ over `n` rows; `tag` tells apart two uses of one weight.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mm(
        &mut self,
        w: &DMatrix,
        x: (&wgpu::Buffer, usize),
        y: (&wgpu::Buffer, usize),
        n: usize,
        add: bool,
        tag: u8,
        name: &'static str,
    ) -> Result<(), BackendError> {
        self.mm_with(w, x, y, n, add, tag, name, false)
    }

    /// Whether the down projection `down` of this step runs as the GEMV, which can read
    /// silu(gate) · up straight from the gate/up rows (the SwiGLU fused into its input).
    pub(super) fn down_takes_swiglu(&self, down: &DMatrix) -> bool {
        down.parts.iter().all(|part| {
            let s = MmShape {
                rows: part.rows,
                cols: down.cols,
                n: self.n,
                x_stride: 2 * down.cols,
                y_stride: 0,
                y_off: 0,
                add: true,
                row_words: 0,
                row0: 0,
            };
            matches!(mm_kernel(self.k, part.ty, &s), Mm::Gemv(..))
        })
    }

    /// [`Self::mm`], the GEMV reading `x` as [gate | up] rows through silu(gate) · up when
    /// `swiglu` (the caller has checked that the GEMV runs).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mm_with(
        &mut self,
        w: &DMatrix,
        x: (&wgpu::Buffer, usize),
        y: (&wgpu::Buffer, usize),
        n: usize,
        add: bool,
        tag: u8,
        name: &'static str,
        swiglu: bool,
    ) -> Result<(), BackendError> {
        for part in &w.parts {
            let s = MmShape {
                rows: part.rows,
                cols: w.cols,
                n,
                x_stride: x.1,
                y_stride: y.1,
                y_off: part.y_off,
                add,
                row_words: part.ty.row_words(w.cols),
                row0: part.row0,
            };
            let (pipe, groups) = match mm_kernel(self.k, part.ty, &s) {
                Mm::Gemm { path, pipe, split } => {
                    self.gemm(part, x.0, y.0, &s, tag, name, (path, pipe, split))?;
                    continue;
                }
                Mm::Gemv(pipe, groups) => (pipe, groups),
            };
            let one = one_token_gemv(part.ty, &s);
            let (pipe, groups, key) = if swiglu {
                let (pipe, groups) = self.k.gemv(part.ty, &s, true);
                let key = if one {
                    Key::Gemv1Swiglu(part.id)
                } else {
                    Key::MatmulSwiglu(part.id)
                };
                (pipe, groups, key)
            } else if one {
                (pipe, groups, Key::Gemv1(part.id, tag))
            } else {
                (pipe, groups, Key::Matmul(part.id, tag))
            };
            let d = self.binder.dispatch(
                self.gpu,
                name,
                key,
                pipe,
                &[(1, &part.buf), (2, x.0), (3, y.0)],
                s.params(),
                groups,
            )?;
            self.list.push(d);
            let (r, c) = (part.rows, w.cols);
            let io = n * (c + r * (1 + add as usize)) * 4;
            self.cost(r * s.row_words * 4 + io, 2 * r * c * n);
        }
        Ok(())
    }

    /// The GEMM of one weight part over `s`, and its reduce when split over columns (both count
    /// as the op `name`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
        &mut self,
        part: &Part,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        s: &MmShape,
        tag: u8,
        name: &'static str,
        (path, pipe, split): (gemm::GemmPath, &wgpu::ComputePipeline, gemm::Split),
    ) -> Result<(), BackendError> {
        let b = self.bufs;
        let key = Key::Gemm(part.id, tag, self.k.gemm.index(path));
        let bufs = [(1, &part.buf), (2, x), (3, y), (4, &b.gemm_part)];
        let groups = path.groups(s, split);
        let d = self
            .binder
            .dispatch(self.gpu, name, key, pipe, &bufs, split.params(s), groups)?;
        self.list.push(d);
        let (r, c, n) = (part.rows, s.cols, s.n);
        let io = n * (c + r * (1 + s.add as usize)) * 4;
        self.cost(r * s.row_words * 4 + io, 2 * r * c * n);
        if split.is_split() {
            let (p, groups) = split.reduce(s);
            let key = Key::GemmReduce(part.id, tag);
            let pipe = &self.k.gemm.reduce;
            let bufs = [(3, y), (4, &b.gemm_part)];
            let d = self
                .binder
                .dispatch(self.gpu, name, key, pipe, &bufs, p, groups)?;
            self.list.push(d);
            let floats = n * r * (split.slices as usize + 1 + s.add as usize);
            self.cost(floats * 4, n * r * split.slices as usize);
        }
        Ok(())
    }

    /// Whether every part of `w` runs the one-token GEMV with a fused norm in this step.
    pub(super) fn norm_fuses(&self, w: &DMatrix, n: usize) -> bool {
        self.fuse
            && self.n == 1
            && n == 1
            && w.parts
                .iter()
                .all(|part| self.k.gemv1(part.ty, GemvIn::Norm).is_some())
    }

    /// Whether the QKV GEMV of `w` (its norm fused) can apply RoPE too: each row's pair is in its
    /// workgroup (even rows per workgroup, parts of even rows at even columns).
    pub(super) fn rope_fuses(&self, w: &DMatrix) -> bool {
        self.rope_in_gemv
            && w.parts.iter().all(|part| {
                let rows = match Gemv::engine(part.ty) {
                    Gemv::Slot { rows, .. } | Gemv::Unit { rows, .. } => rows,
                    Gemv::Multi => 1,
                };
                rows % 2 == 0 && part.rows % 2 == 0 && part.y_off % 2 == 0
            })
    }

    /// `y` (+)= RMSNorm(`X`) · `g`, times `w`ᵀ, for the step's one token, with RoPE on the
    /// output's Q and K rows if `rope` (the caller has checked [`Self::norm_fuses`] and, for
    /// RoPE, [`Self::rope_fuses`]).
    pub(super) fn mm_norm(
        &mut self,
        w: &DMatrix,
        g: &wgpu::Buffer,
        y: (&wgpu::Buffer, usize),
        rope: bool,
        name: &'static str,
    ) -> Result<(), BackendError> {
        let (b, c) = (self.bufs, self.cfg);
        let input = if rope { GemvIn::NormRope } else { GemvIn::Norm };
        let rot = rope.then(|| {
            (
                c.head_dim,
                c.rope_dim / 2,
                self.shape.q_size() + self.shape.kv_size(),
            )
        });
        for part in &w.parts {
            let s = MmShape {
                rows: part.rows,
                cols: w.cols,
                n: 1,
                x_stride: c.hidden_size,
                y_stride: y.1,
                y_off: part.y_off,
                add: false,
                row_words: part.ty.row_words(w.cols),
                row0: part.row0,
            };
            let pipe = self.k.gemv1(part.ty, input).expect("checked: norm_fuses");
            let key = if rope {
                Key::Gemv1NormRope(part.id)
            } else {
                Key::Gemv1Norm(part.id)
            };
            let mut buffers = vec![(1, &part.buf), (2, &b.x), (3, y.0), (5, g)];
            if rope {
                buffers.push((6, &b.rope));
            }
            let groups = Gemv::engine(part.ty).groups(&s);
            let d = self.binder.dispatch(
                self.gpu,
                name,
                key,
                pipe,
                &buffers,
                s.fused_params(c.rms_norm_eps, rot),
                groups,
            )?;
            self.list.push(d);
            let (r, cols) = (part.rows, w.cols);
            self.cost(r * s.row_words * 4 + (2 * cols + r) * 4, 2 * r * cols);
        }
        Ok(())
    }
}
