#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use salus_graph::{Attr, DType, Graph, Limits, Node, Op, Precision, Role, Tensor, TensorType};

use super::*;

fn touch(path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, b"").unwrap();
}

fn dirs_with(root: &Path, vars: &[(&str, PathBuf)]) -> Vec<PathBuf> {
    let vars: HashMap<String, PathBuf> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    candidate_dirs(&|k| vars.get(k).cloned(), root)
}

#[test]
fn finds_the_pip_wheel_under_a_virtual_environment() {
    let root = tempfile::tempdir().unwrap();
    let venv = root.path().join("venv");
    let lib = venv.join("lib/python3.12/site-packages/nvidia/cudnn/lib");
    touch(&lib.join(SONAME));
    touch(&lib.join("libcudnn_ops.so.9"));
    let dirs = dirs_with(root.path(), &[("VIRTUAL_ENV", venv.clone())]);
    assert_eq!(find(&dirs), Some(lib));
}

#[test]
fn finds_the_system_python_dist_packages_wheel() {
    let root = tempfile::tempdir().unwrap();
    let lib = root
        .path()
        .join("usr/local/lib/python3.12/dist-packages/nvidia/cudnn/lib");
    touch(&lib.join(SONAME));
    assert_eq!(find(&dirs_with(root.path(), &[])), Some(lib));
}

#[test]
fn an_explicit_folder_and_cuda_come_before_python() {
    let root = tempfile::tempdir().unwrap();
    let wheel = root
        .path()
        .join("usr/lib/python3.11/site-packages/nvidia/cudnn/lib");
    touch(&wheel.join(SONAME));
    let cuda = root.path().join("usr/local/cuda/lib64");
    touch(&cuda.join(SONAME));
    assert_eq!(find(&dirs_with(root.path(), &[])), Some(cuda.clone()));
    let mine = root.path().join("mine");
    touch(&mine.join(SONAME));
    let dirs = dirs_with(root.path(), &[("SALUS_CUDNN_DIR", mine.clone())]);
    assert_eq!(dirs[0], mine);
    assert_eq!(find(&dirs), Some(mine));
}

#[test]
fn newest_python_first_and_nothing_without_the_soname() {
    let root = tempfile::tempdir().unwrap();
    let old = root
        .path()
        .join("usr/lib/python3.10/site-packages/nvidia/cudnn/lib");
    let new = root
        .path()
        .join("usr/lib/python3.12/site-packages/nvidia/cudnn/lib");
    touch(&old.join(SONAME));
    touch(&new.join(SONAME));
    assert_eq!(find(&dirs_with(root.path(), &[])), Some(new));
    let empty = tempfile::tempdir().unwrap();
    // Only an unversioned name, or only sub-libraries: not cuDNN 9's shim.
    touch(&empty.path().join("usr/local/cuda/lib64/libcudnn.so"));
    touch(&empty.path().join("usr/local/cuda/lib64/libcudnn_ops.so.9"));
    assert_eq!(find(&dirs_with(empty.path(), &[])), None);
}

#[test]
fn sublibraries_are_recognised_by_name() {
    assert!(is_sublibrary("libcudnn_ops.so.9"));
    assert!(is_sublibrary("libcudnn_engines_precompiled.so.9.10.2"));
    assert!(!is_sublibrary("libcudnn.so.9"));
    assert!(!is_sublibrary("libcudnn_ops.so"));
    assert!(!is_sublibrary("libcublas.so.13"));
}

fn conv_graph(dtype: DType, spatial: &[u64], kernel: &[u64], groups: u64, backward: bool) -> Graph {
    let t = |name: &str, shape: Vec<u64>, role| Tensor {
        name: name.into(),
        ty: TensorType::new(dtype, shape),
        role,
        data: vec![],
    };
    let n = spatial.len();
    let mut x = vec![2, 4];
    x.extend(spatial);
    let mut w = vec![6, 4 / groups];
    w.extend(kernel);
    let mut y = vec![2, 6];
    y.extend(spatial.iter().zip(kernel).map(|(s, k)| s - k + 1));
    let ints = |v: u64| Attr::Ints(vec![v as i64; n]);
    let mut attrs = BTreeMap::from([
        ("stride".to_string(), ints(1)),
        ("padding".to_string(), ints(0)),
        ("dilation".to_string(), ints(1)),
        ("transposed".to_string(), Attr::Bool(false)),
        ("output_padding".to_string(), ints(0)),
        ("groups".to_string(), Attr::Int(groups as i64)),
    ]);
    let mut tensors = vec![
        t("x", x.clone(), Role::Feed),
        t("w", w.clone(), Role::Parameter),
        t("y", y.clone(), Role::Intermediate),
    ];
    let mut nodes = vec![Node {
        name: "conv".into(),
        op: Op::Convolution,
        inputs: vec![Some(0), Some(1), None],
        outputs: vec![Some(2)],
        attrs: attrs.clone(),
        source: String::new(),
    }];
    let mut fetches = vec![2];
    if backward {
        tensors.push(t("gx", x, Role::Intermediate));
        tensors.push(t("gw", w, Role::Intermediate));
        attrs.insert("bias_sizes".into(), Attr::Ints(vec![6]));
        attrs.insert("output_mask".into(), Attr::Bools(vec![true, true, false]));
        nodes.push(Node {
            name: "conv_backward".into(),
            op: Op::ConvolutionBackward,
            inputs: vec![Some(2), Some(0), Some(1)],
            outputs: vec![Some(3), Some(4), None],
            attrs,
            source: String::new(),
        });
        fetches = vec![3, 4];
    }
    Graph {
        tensors,
        nodes,
        fetches,
        updates: vec![],
        precision: Precision::IEEE,
    }
}

#[test]
fn a_1d_grouped_convolution_becomes_a_2d_one_of_height_1() {
    let graph = conv_graph(DType::F32, &[10], &[3], 2, true);
    let checked = salus_graph::check(&graph, &Limits::default()).unwrap();
    let (shape, directions) = conv_shape(&graph, 0, checked.params(0)).unwrap();
    assert_eq!(shape.x, vec![2, 4, 1, 10]);
    assert_eq!(shape.w, vec![6, 2, 1, 3]);
    assert_eq!(shape.y, vec![2, 6, 1, 8]);
    assert_eq!(
        (shape.pad.clone(), shape.stride.clone()),
        (vec![0, 0], vec![1, 1])
    );
    assert_eq!(shape.groups, 2);
    assert!(!shape.tf32);
    assert_eq!(directions, vec![Direction::Forward]);
    let (_, directions) = conv_shape(&graph, 1, checked.params(1)).unwrap();
    assert_eq!(
        directions,
        vec![Direction::BackwardData, Direction::BackwardFilter]
    );
}

#[test]
fn three_d_and_bf16_convolutions_qualify_and_tf32_follows_the_graph() {
    let graph = conv_graph(DType::Bf16, &[4, 5, 6], &[2, 2, 2], 1, false);
    let checked = salus_graph::check(&graph, &Limits::default()).unwrap();
    let (shape, _) = conv_shape(&graph, 0, checked.params(0)).unwrap();
    assert_eq!(shape.x.len(), 5);
    assert_eq!(shape.ty, DnnType::Bf16);
    let mut graph = conv_graph(DType::F32, &[6, 6], &[3, 3], 1, false);
    graph.precision = Precision::default();
    let checked = salus_graph::check(&graph, &Limits::default()).unwrap();
    let (shape, _) = conv_shape(&graph, 0, checked.params(0)).unwrap();
    assert!(shape.tf32, "PyTorch's default lets convolutions use TF32");
}
