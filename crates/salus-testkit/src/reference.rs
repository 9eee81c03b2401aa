//! Reading reference runs written by `python -m salus.reference` (format in that module's
//! docstring): a graph, its initial persistent tensors, batches, and PyTorch's results.
//! Used to check and benchmark devices against real PyTorch numbers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use salus_cpu::CpuDevice;
use salus_exec::{Device, ExecError, Location, Placement, Program};
use salus_graph::{Graph, Limits, Role};

/// Named tensors as raw little-endian bytes.
pub type Tensors = HashMap<String, Vec<u8>>;

/// One model's reference run.
#[derive(Debug)]
pub struct ReferenceRun {
    /// Its directory.
    pub dir: PathBuf,
    /// The training step, validated and planned.
    pub program: Program,
    /// Persistent tensors before the first step.
    pub initial: Tensors,
    /// Feeds of each step.
    pub batches: Vec<Tensors>,
    /// Persistent tensors after the steps, per PyTorch.
    pub final_state: Tensors,
    /// PyTorch's loss of each step.
    pub losses: Vec<f64>,
}

fn field<'a>(v: &'a Json, key: &str) -> Result<&'a Json, String> {
    v.get(key)
        .ok_or_else(|| format!("manifest: missing {key:?}"))
}

type Json = serde_json::Value;

fn section(dir: &Path, v: &Json) -> Result<Tensors, String> {
    let file = field(v, "file")?
        .as_str()
        .ok_or("manifest: file is not a string")?;
    let bytes =
        std::fs::read(dir.join(file)).map_err(|e| format!("{}: {e}", dir.join(file).display()))?;
    let mut out = HashMap::new();
    for t in field(v, "tensors")?
        .as_array()
        .ok_or("manifest: tensors is not a list")?
    {
        let name = field(t, "name")?.as_str().unwrap_or_default().to_string();
        let offset = field(t, "offset")?.as_u64().unwrap_or(0) as usize;
        let len = field(t, "nbytes")?.as_u64().unwrap_or(0) as usize;
        let data = bytes
            .get(offset..offset + len)
            .ok_or_else(|| format!("{file}: {name} lies outside the file"))?;
        out.insert(name, data.to_vec());
    }
    Ok(out)
}

impl ReferenceRun {
    /// Loads `dir` (one model of a reference set).
    pub fn load(dir: &Path) -> Result<ReferenceRun, String> {
        let text = std::fs::read(dir.join("manifest.json"))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        let manifest: Json =
            serde_json::from_slice(&text).map_err(|e| format!("manifest.json: {e}"))?;
        let graph_file = field(&manifest, "graph")?.as_str().unwrap_or("graph.pb");
        let graph = Graph::decode(&std::fs::read(dir.join(graph_file)).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        let program = Program::new(graph, &Limits::default()).map_err(|e| e.to_string())?;
        let batches = field(&manifest, "batches")?
            .as_array()
            .ok_or("manifest: batches is not a list")?
            .iter()
            .map(|b| section(dir, b))
            .collect::<Result<_, _>>()?;
        let final_state = match manifest.get("final") {
            Some(f) => section(dir, f)?,
            None => Tensors::new(),
        };
        let losses = manifest
            .get("losses")
            .and_then(Json::as_array)
            .map(|l| l.iter().filter_map(Json::as_f64).collect())
            .unwrap_or_default();
        Ok(ReferenceRun {
            dir: dir.to_path_buf(),
            program,
            initial: section(dir, field(&manifest, "initial")?)?,
            batches,
            final_state,
            losses,
        })
    }

    /// Plans the program again for `device`, so each node's scratch is what that device's
    /// kernels work in (a GPU's cuDNN workspaces) and E is exact there, as salusd plans a
    /// session for its device.
    pub fn plan_for(&mut self, device: &dyn Device) -> Result<(), String> {
        let graph = self.program.graph().clone();
        self.program =
            Program::for_device(graph, &Limits::default(), device).map_err(|e| e.to_string())?;
        Ok(())
    }

    /// Arena offset of a persistent tensor of the program, for a session placed at `at`.
    pub fn offset_of(&self, at: Placement, name: &str) -> Result<u64, String> {
        let id = self
            .program
            .graph()
            .tensors
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| format!("{name} is not a tensor of the graph"))?;
        match self.program.location(id) {
            Some(Location::Persistent(off)) => Ok(at.persistent + off),
            _ => Err(format!("{name} is not persistent")),
        }
    }

    /// A CPU device just large enough for this run, with the initial state uploaded; the
    /// session's persistent block at 0 and its lane right after it.
    pub fn on_cpu(&self) -> Result<(CpuDevice, Placement), String> {
        let plan = self.program.plan();
        let at = Placement {
            persistent: 0,
            lane: plan.persistent_bytes,
        };
        let device = CpuDevice::new(plan.persistent_bytes + plan.ephemeral_bytes)
            .map_err(|e| e.to_string())?;
        self.upload(&device, at)?;
        Ok((device, at))
    }

    /// Uploads the initial state and the graph's constants.
    pub fn upload(&self, device: &dyn Device, at: Placement) -> Result<(), String> {
        // Constants carry their value in the graph (as salusd copies it into a session's
        // image); the reference files hold the parameters and state.
        let constants = self
            .program
            .graph()
            .tensors
            .iter()
            .filter(|t| t.role == Role::Constant && !self.initial.contains_key(&t.name))
            .map(|t| (&t.name, &t.data));
        for (name, bytes) in self.initial.iter().chain(constants) {
            device
                .write(self.offset_of(at, name)?, bytes)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// The feeds of batch `k`, in the program's feed order.
    pub fn feeds(&self, k: usize) -> Vec<&[u8]> {
        let batch = &self.batches[k % self.batches.len().max(1)];
        self.program
            .feeds()
            .iter()
            .map(|&id| {
                batch
                    .get(&self.program.graph().tensors[id].name)
                    .map_or(&[][..], Vec::as_slice)
            })
            .collect()
    }

    /// Runs step `k`; the first fetch (the loss) as f32.
    pub fn step(&self, device: &dyn Device, at: Placement, k: usize) -> Result<f32, ExecError> {
        let outcome = device.run(&self.program, at, &self.feeds(k))?;
        let loss = outcome
            .fetches
            .first()
            .and_then(|b| b.get(..4))
            .map_or(f32::NAN, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        Ok(loss)
    }
}
