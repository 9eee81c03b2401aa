//! A session's further programs: its step for other feed shapes (a smaller last batch,
//! another batch size), sharing the persistent block of the program it opened with.

use std::collections::HashMap;
use std::sync::Arc;

use salus_exec::{Location, Program};
use salus_graph::Role;

use super::{EngineError, Entry};

/// Most programs one session may hold (each keeps its plan and the device's lowered
/// form of it).
pub const MAX_PROGRAMS: usize = 64;

impl Entry {
    /// Adds `program` after checking that it reads and writes the session's persistent
    /// tensors exactly where its first program does and fits the scratch it was given;
    /// returns the program's number.
    pub(super) fn add_program(
        &mut self,
        session: u64,
        program: Program,
    ) -> Result<u32, EngineError> {
        if self.programs.len() >= MAX_PROGRAMS {
            return Err(EngineError::ProgramMismatch {
                session,
                why: format!("a session holds at most {MAX_PROGRAMS} programs"),
            });
        }
        same_persistent_block(self.program(), &program)
            .map_err(|why| EngineError::ProgramMismatch { session, why })?;
        let (have, need) = (
            self.program().plan().ephemeral_bytes,
            program.plan().ephemeral_bytes,
        );
        if need > have {
            return Err(EngineError::ProgramTooLarge {
                session,
                need,
                have,
            });
        }
        self.programs.push(Arc::new(program));
        Ok((self.programs.len() - 1) as u32)
    }
}

/// Whether `other` has the persistent tensors of `first` (names, roles, dtypes and
/// shapes; constants' values), each at the same place, and no others.
fn same_persistent_block(first: &Program, other: &Program) -> Result<(), String> {
    let persistent = |p: &Program| -> HashMap<String, usize> {
        p.graph()
            .tensors
            .iter()
            .enumerate()
            .filter(|(_, t)| matches!(t.role, Role::Parameter | Role::State | Role::Constant))
            .map(|(id, t)| (t.name.clone(), id))
            .collect()
    };
    let (mine, theirs) = (persistent(first), persistent(other));
    if let Some(name) = theirs.keys().find(|n| !mine.contains_key(*n)) {
        return Err(format!(
            "its persistent tensor '{name}' is not the session's"
        ));
    }
    if let Some(name) = mine.keys().find(|n| !theirs.contains_key(*n)) {
        return Err(format!("it lacks the session's persistent tensor '{name}'"));
    }
    for (name, &a) in &mine {
        let b = theirs[name];
        let (ta, tb) = (&first.graph().tensors[a], &other.graph().tensors[b]);
        if ta.role != tb.role || ta.ty != tb.ty {
            return Err(format!(
                "its tensor '{name}' is {:?} {}, the session's is {:?} {}",
                tb.role, tb.ty, ta.role, ta.ty
            ));
        }
        if ta.role == Role::Constant && ta.data != tb.data {
            return Err(format!(
                "its constant '{name}' has other values than the session's"
            ));
        }
        let place = |p: &Program, id: usize| match p.location(id) {
            Some(Location::Persistent(off)) => Some(off),
            _ => None,
        };
        if place(first, a) != place(other, b) {
            return Err(format!(
                "its tensor '{name}' lies elsewhere in the persistent block"
            ));
        }
    }
    Ok(())
}
