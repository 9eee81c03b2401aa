//! The GPU's load through NVML: SM activity (GPU performance monitoring, on Hopper and
//! newer) and the SM clock against its highest, for protection's health metrics.

use std::sync::OnceLock;

use nvml_wrapper::enum_wrappers::device::Clock;
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::gpm::{GpmSample, gpm_metrics_get};
use nvml_wrapper::{Device as NvmlDevice, Nvml};
use salus_exec::{Load, LoadMonitor};

/// NVML, loaded once for the process: its devices and samples borrow it.
fn nvml() -> Result<&'static Nvml, String> {
    static NVML: OnceLock<Result<Nvml, String>> = OnceLock::new();
    NVML.get_or_init(|| Nvml::init().map_err(|e| format!("NVML: {e}")))
        .as_ref()
        .map_err(Clone::clone)
}

/// One GPU's load, read through NVML.
pub(crate) struct Monitor {
    device: NvmlDevice<'static>,
    /// The highest SM clock, MHz.
    highest_clock: Option<f64>,
    /// The last GPM sample, where the GPU has GPM: SM activity is the difference of two.
    gpm: Option<GpmSample<'static>>,
}

impl Monitor {
    /// The monitor of the GPU at `pci_bus_id` (NVML numbers GPUs its own way: the bus id
    /// is what CUDA and NVML agree on).
    pub(crate) fn open(pci_bus_id: &str) -> Result<Monitor, String> {
        let device = nvml()?
            .device_by_pci_bus_id(pci_bus_id)
            .map_err(|e| format!("NVML has no GPU at {pci_bus_id}: {e}"))?;
        let highest_clock = device
            .max_clock_info(Clock::SM)
            .ok()
            .map(f64::from)
            .filter(|&c| c > 0.0);
        let gpm = match device.gpm_support() {
            Ok(true) => device.gpm_sample().ok(),
            _ => None,
        };
        if highest_clock.is_none() && gpm.is_none() {
            return Err(format!(
                "NVML reports neither the SM clock nor SM activity of the GPU at {pci_bus_id}"
            ));
        }
        Ok(Monitor {
            device,
            highest_clock,
            gpm,
        })
    }

    /// SM activity since the last GPM sample, taking a new one; `None` without GPM (and
    /// from the first failure on).
    fn sm_activity(&mut self) -> Option<f64> {
        let last = self.gpm.take()?;
        let now = self.device.gpm_sample().ok()?;
        let activity = gpm_metrics_get(nvml().ok()?, &last, &now, &[GpmMetricId::SmUtil])
            .ok()?
            .into_iter()
            .next()?
            .ok()
            .map(|m| (m.value / 100.0).clamp(0.0, 1.0));
        self.gpm = Some(now);
        activity
    }
}

impl LoadMonitor for Monitor {
    fn read(&mut self) -> Result<Load, String> {
        let clock = self.device.clock_info(Clock::SM).ok().map(f64::from);
        Ok(Load {
            sm_activity: self.sm_activity(),
            sm_clock: clock.zip(self.highest_clock),
        })
    }
}
