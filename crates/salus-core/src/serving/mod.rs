//! Request serving: which inference requests run together in the next batch, and which are
//! dropped because they can no longer meet their deadlines.
//!
//! Separate from session admission (the [`crate::Scheduler`]): a served model is one
//! session whose iterations are batches of requests; this module decides what goes into
//! each batch.
pub mod hull;

pub use hull::{HullPoint, HullQueue};
