//! Fluid: how many devices each trial of a hyperparameter-tuning job gets (dissertation
//! ch. 3 and appendix B).
//!
//! A tuning algorithm hands its trials over as **TrialGroups** (a group of trials, each
//! with a training budget: a grid search is one group, each rung of a synchronous
//! Hyperband bracket is one). This crate decides, for each trial, a *width*: a share of
//! one device packed with other trials (intra-GPU sharing, at most `c` per device) or
//! several whole devices (inter-GPU training, at most `d`):
//!
//! - [`degree`]: the packing degree `c` from measured iteration times (Eq. 3.1) and the
//!   scaling degree `d`, the runtime of a trial at a width (Eq. 3.2, from the same
//!   measurements);
//! - [`plan`]: StaticFluid's widths for a group on idle resources (Algorithm 3.1, Eq. B.1)
//!   and DynamicFluid's target widths (Algorithm 3.2);
//! - [`Planner`]: both, as a deterministic state machine over a set of devices, in the
//!   style of `salus-core`: events in ([`Event`]), placements and resizes out
//!   ([`Action`]).
//!
//! It is sans-IO: no clocks, threads or devices. It owns the decisions only; the
//! simulator (`salus-sim experiment fluid`) drives it in virtual time and the Python
//! adaptor's `salus.tune` mirrors its functions (checked against the shared test vectors
//! in `tests/vectors.json`). What runs inside a device (memory lanes, iteration order) is
//! `salus-core`'s business, not this crate's.
//!
//! ```
//! use salus_fluid::{Action, Event, Placement, Planner, PlannerConfig, TrialId};
//!
//! // 5 devices, at most 2 trials per device, at most 3 devices per trial: the chapter's
//! // toy example (Fig. 3.5) of four trials of 4, 4, 12 and 30 s.
//! let mut fluid = Planner::new(PlannerConfig::ideal(5, 2, 3));
//! fluid.handle(Event::GroupSubmitted(vec![
//!     (TrialId(1), 4.0), (TrialId(2), 4.0), (TrialId(3), 12.0), (TrialId(4), 30.0),
//! ]));
//! let actions = fluid.poll();
//! // The 30 s trial gets three devices of its own.
//! assert!(actions.contains(&Action::Place {
//!     trial: TrialId(4),
//!     placement: Placement::Exclusive(vec![0, 1, 2]),
//! }));
//! ```

pub mod degree;
pub mod plan;
mod planner;

pub use degree::{
    RuntimeModel, packing_degree, packing_marginal_benefit, scaling_degree,
    scaling_marginal_benefit,
};
pub use plan::{TrialId, Width, dynamic_target, static_widths};
pub use planner::{Action, Event, Placement, Planner, PlannerConfig};
