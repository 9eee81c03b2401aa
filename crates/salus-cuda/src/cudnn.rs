//! cuDNN, when the host has it: finding and loading the library, and planning each
//! convolution's algorithms and workspace once, when a program is planned.
//!
//! **Finding `libcudnn.so.9`.** In order: the folder `$SALUS_CUDNN_DIR` names; the
//! loader's own path (`LD_LIBRARY_PATH`, `ldconfig`'s folders); CUDA's folders
//! (`$CUDNN_HOME`, `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`); the `nvidia-cudnn-cu*`
//! wheel PyTorch installs, `site-packages/nvidia/cudnn/lib` under `$VIRTUAL_ENV`,
//! `$CONDA_PREFIX`, `~/.local`, `/usr/local`, `/usr` and `/opt/conda`; last, the folder
//! `python3` (`$SALUS_PYTHON`) reports for `nvidia.cudnn`. Found in a folder, the library
//! and its sub-libraries are loaded from there by absolute path (see
//! `driver::cudnn::preload`). `SALUS_CUDNN=off` turns cuDNN off.
//!
//! **Planning.** A convolution (forward, or backward with its `output_mask`) whose
//! operands are all f32, f16 or bf16, not transposed, with 1 to 3 spatial dimensions,
//! runs on cuDNN when cuDNN offers an algorithm for every call it needs. Algorithms come
//! from cuDNN's heuristics (`cudnnGetConvolution*Algorithm_v7`), not from timing runs
//! (`cudnnFind*AlgorithmEx`): timing needs the operands and a workspace in GPU memory,
//! which at planning time would be memory outside the arena (the lanes belong to running
//! sessions), and the heuristics give the same answer on every run, so E never depends on
//! timing noise. Choices are cached for the device's life by (shape, dtype, math mode,
//! call); the GPU is the device's own. The node's scratch is the largest workspace of its
//! calls, so E includes it exactly; anything cuDNN refuses while planning leaves the node
//! on the backend's own kernels (im2col and cuBLAS, or the direct kernels) with a log line
//! saying why.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use salus_graph::{DType, Graph, Op, OpParams};

use crate::driver::cudnn::{self as dnn, Choice, ConvShape, Direction, DnnType, Handle};

/// The name the library goes by (cuDNN 9).
pub(crate) const SONAME: &str = "libcudnn.so.9";

/// Most bytes of workspace one convolution call may take: algorithms that want more are
/// passed over for the next one cuDNN ranks.
pub const WORKSPACE_LIMIT: u64 = 512 << 20;

/// True for a cuDNN 9 sub-library file name (`libcudnn_ops.so.9`, `libcudnn_cnn.so.9.1.0`).
pub(crate) fn is_sublibrary(name: &str) -> bool {
    name.starts_with("libcudnn_") && name.contains(".so.9") && !name.ends_with(".so")
}

/// The folders that may hold `libcudnn.so.9`, in the order they are tried. `var` reads the
/// environment; fixed folders are taken under `root` (`/` outside tests).
pub(crate) fn candidate_dirs(var: &dyn Fn(&str) -> Option<PathBuf>, root: &Path) -> Vec<PathBuf> {
    let under = |p: &str| root.join(p.trim_start_matches('/'));
    let mut dirs = Vec::new();
    if let Some(d) = var("SALUS_CUDNN_DIR") {
        dirs.push(d);
    }
    for v in ["CUDNN_HOME", "CUDA_HOME", "CUDA_PATH"] {
        if let Some(d) = var(v) {
            dirs.push(d.join("lib64"));
            dirs.push(d.join("lib"));
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
    ] {
        dirs.push(under(d));
    }
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|v| var(v))
        .collect();
    if let Some(home) = var("HOME") {
        prefixes.push(home.join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr", "/opt/conda"].map(under));
    for prefix in prefixes {
        let lib = prefix.join("lib");
        let mut pythons: Vec<PathBuf> = std::fs::read_dir(&lib)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        // Newest Python first.
        pythons.sort_by(|a, b| b.cmp(a));
        for py in pythons {
            for packages in ["site-packages", "dist-packages"] {
                dirs.push(py.join(packages).join("nvidia/cudnn/lib"));
            }
        }
    }
    dirs.push(under("/usr/lib/python3/dist-packages/nvidia/cudnn/lib"));
    dirs
}

/// The first of `dirs` that holds `libcudnn.so.9`.
pub(crate) fn find(dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter().find(|d| d.join(SONAME).is_file()).cloned()
}

/// The folder `python3 -c 'import nvidia.cudnn'` finds the wheel's libraries in.
fn python_dir() -> Option<PathBuf> {
    let python = std::env::var_os("SALUS_PYTHON").unwrap_or_else(|| "python3".into());
    let out = std::process::Command::new(python)
        .args([
            "-c",
            "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))",
        ])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (out.status.success() && dir.join(SONAME).is_file()).then_some(dir)
}

/// Where the library was loaded from, once per process.
fn load() -> Result<String, String> {
    static LOADED: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    LOADED
        .get_or_init(|| {
            let var = |k: &str| {
                std::env::var_os(k)
                    .filter(|v| !v.is_empty())
                    .map(PathBuf::from)
            };
            if var("SALUS_CUDNN")
                .is_some_and(|v| matches!(v.to_str(), Some("off" | "0" | "false" | "no")))
            {
                return Err("turned off by SALUS_CUDNN".into());
            }
            let explicit = var("SALUS_CUDNN_DIR");
            if explicit.is_none() && dnn::present() {
                return Ok("the loader's path".into());
            }
            let dirs = candidate_dirs(&var, Path::new("/"));
            let Some(dir) = find(&dirs).or_else(python_dir) else {
                return Err(format!(
                    "{SONAME} not found on the loader's path, in CUDA's folders or in a \
                     Python nvidia-cudnn wheel (set SALUS_CUDNN_DIR to its folder)"
                ));
            };
            let missing = dnn::preload(&dir)?;
            if !dnn::present() {
                return Err(format!("{SONAME} in {} does not load", dir.display()));
            }
            let mut from = dir.display().to_string();
            if !missing.is_empty() {
                from += &format!(" (not loaded: {})", missing.join(", "));
            }
            Ok(from)
        })
        .clone()
}

/// The cuDNN of one device: a handle for planning queries and the algorithms chosen.
pub(crate) struct Dnn {
    /// "cuDNN 9.10.2".
    pub version: String,
    planner: Mutex<Handle>,
    chosen: Mutex<HashMap<(ConvShape, Direction), Result<Choice, String>>>,
}

impl Drop for Dnn {
    fn drop(&mut self) {
        if let Ok(h) = self.planner.lock() {
            dnn::destroy_handle(*h);
        }
    }
}

/// The calls one convolution node makes on cuDNN.
#[derive(Debug, Clone)]
pub(crate) struct NodePlan {
    pub shape: ConvShape,
    pub calls: Vec<Choice>,
}

impl NodePlan {
    /// Bytes of scratch the node needs: the largest workspace of its calls, which run one
    /// after another on the lane's stream.
    pub fn workspace(&self) -> u64 {
        self.calls.iter().map(|c| c.workspace).max().unwrap_or(0)
    }
}

impl Dnn {
    /// Loads cuDNN and makes the planning handle, in the current context; `Err` says why
    /// there is no cuDNN.
    pub fn open() -> Result<Dnn, String> {
        let from = load()?;
        let (major, minor, patch) = dnn::version()?;
        if major != 9 {
            return Err(format!(
                "cuDNN {major}.{minor}.{patch} found; salus uses cuDNN 9"
            ));
        }
        let planner = dnn::new_handle(None)?;
        Ok(Dnn {
            version: format!("cuDNN {major}.{minor}.{patch} from {from}"),
            planner: Mutex::new(planner),
            chosen: Mutex::new(HashMap::new()),
        })
    }

    /// The cuDNN calls node `index` of `graph` makes, or `None` when it runs on the
    /// backend's own kernels (not a convolution cuDNN takes, or cuDNN refused it: logged
    /// once per shape).
    pub fn plan_node(&self, graph: &Graph, index: usize, params: &OpParams) -> Option<NodePlan> {
        let (shape, directions) = conv_shape(graph, index, params)?;
        let mut calls = Vec::with_capacity(directions.len());
        for direction in directions {
            let key = (shape.clone(), direction);
            let mut chosen = self.chosen.lock().ok()?;
            let choice = chosen.entry(key).or_insert_with(|| {
                let planner = self
                    .planner
                    .lock()
                    .map_err(|_| "planner lock poisoned".to_string());
                let result =
                    crate::no_panic(|| dnn::choose(*planner?, &shape, direction, WORKSPACE_LIMIT));
                if let Err(why) = &result {
                    let node = &graph.nodes[index];
                    tracing::warn!(
                        node = %node.name,
                        op = %node.op.name(),
                        shape = ?shape,
                        "cuDNN refused this convolution ({why}); it runs on salus' own kernels"
                    );
                }
                result
            });
            calls.push(choice.clone().ok()?);
        }
        Some(NodePlan { shape, calls })
    }
}

fn i32s(v: &[u64]) -> Option<Vec<i32>> {
    v.iter().map(|&x| i32::try_from(x).ok()).collect()
}

/// The cuDNN shape of node `index` and the calls it needs, when cuDNN can run it.
pub(crate) fn conv_shape(
    graph: &Graph,
    index: usize,
    params: &OpParams,
) -> Option<(ConvShape, Vec<Direction>)> {
    let node = graph.nodes.get(index)?;
    let conv = params.conv()?;
    if conv.transposed || conv.input.is_empty() || conv.input.len() > 3 {
        return None;
    }
    let tensor = |id: Option<usize>| id.map(|id| &graph.tensors[id].ty);
    let input = |k: usize| tensor(node.inputs.get(k).copied().flatten());
    let output = |k: usize| tensor(node.outputs.get(k).copied().flatten());
    let (operands, directions) = match node.op {
        Op::Convolution => (
            vec![input(0)?, input(1)?, output(0)?],
            vec![Direction::Forward],
        ),
        Op::ConvolutionBackward => {
            let mut operands = vec![input(0)?, input(1)?, input(2)?];
            let mut directions = Vec::new();
            if conv.output_mask[0]
                && let Some(gi) = output(0)
            {
                operands.push(gi);
                directions.push(Direction::BackwardData);
            }
            if conv.output_mask[1]
                && let Some(gw) = output(1)
            {
                operands.push(gw);
                directions.push(Direction::BackwardFilter);
            }
            if directions.is_empty() {
                return None;
            }
            (operands, directions)
        }
        _ => return None,
    };
    let dtype = operands[0].dtype;
    if operands.iter().any(|t| t.dtype != dtype) {
        return None;
    }
    let ty = match dtype {
        DType::F32 => DnnType::F32,
        DType::F16 => DnnType::F16,
        DType::Bf16 => DnnType::Bf16,
        _ => return None,
    };
    let n = conv.input.len();
    if [
        &conv.kernel,
        &conv.output,
        &conv.padding,
        &conv.stride,
        &conv.dilation,
    ]
    .iter()
    .any(|v| v.len() != n)
    {
        return None;
    }
    // A 1-d convolution is a 2-d one of height 1.
    let lift = |v: &[u64], fill: u64| -> Vec<u64> {
        let mut out = Vec::with_capacity(3);
        if n == 1 {
            out.push(fill);
        }
        out.extend_from_slice(v);
        out
    };
    let dims = |n: u64, c: u64, spatial: &[u64], fill: u64| -> Option<Vec<i32>> {
        let mut all = vec![n, c];
        all.extend(lift(spatial, fill));
        i32s(&all)
    };
    let shape = ConvShape {
        ty,
        tf32: graph.precision.conv_tf32,
        x: dims(conv.batch, conv.in_channels, &conv.input, 1)?,
        w: dims(conv.out_channels, conv.in_per_group(), &conv.kernel, 1)?,
        y: dims(conv.batch, conv.out_channels, &conv.output, 1)?,
        pad: i32s(&lift(&conv.padding, 0))?,
        stride: i32s(&lift(&conv.stride, 1))?,
        dilation: i32s(&lift(&conv.dilation, 1))?,
        groups: i32::try_from(conv.groups).ok()?,
    };
    // Elements must be addressable with 32-bit indices, as cuDNN's legacy API requires.
    let fits = |d: &[i32]| {
        d.iter()
            .try_fold(1i64, |n, &x| n.checked_mul(i64::from(x)))
            .is_some_and(|n| n < i64::from(i32::MAX))
    };
    if !(fits(&shape.x) && fits(&shape.w) && fits(&shape.y)) {
        return None;
    }
    Some((shape, directions))
}

#[cfg(test)]
mod tests;
