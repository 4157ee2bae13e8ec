//! The backends serve runs: spawning and stopping them (`supervisor`), watching their
//! progress (`watchdog`), calls between the route and its backends (`route_calls`), and whether what answers on a
//! backend's port is the backend (`port_owner`).
//!
//! This room knows nothing of how client requests are relayed.

pub mod health;
pub mod port_owner;
pub mod route_calls;
pub mod supervisor;
pub mod watchdog;
