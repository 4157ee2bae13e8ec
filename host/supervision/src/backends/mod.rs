//! The backends serve runs: spawning and stopping them (`supervisor`), whether they answer
//! (`health`: the status, serve's own probe client, the health monitor), whether what answers
//! on a backend's port is the backend (`port_owner`), watching their progress (`watchdog`),
//! calls between the route and its backends (`route_calls`), and, at a stop, whether each
//! backend let go of the connections serve cut (`idle_before_stop`).
//!
//! This crate knows nothing of how client requests are relayed (Cargo holds it).

pub mod health;
pub mod idle_before_stop;
pub mod port_owner;
pub mod route_calls;
mod sock_diag;
pub mod supervisor;
mod tcp_table;
pub mod watchdog;
