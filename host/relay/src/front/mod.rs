//! The front door: serve's listening socket (`accept`) and serve's own routes with the axum
//! router around the general engine (`endpoints`, and `worker`: what a gateway asks of a worker),
//! and the drain on SIGTERM that says so on `/health`, stops accepting and waits for the
//! requests in flight (`drain`).
//!
//! The front sits above the rest of this crate: it hands each connection to the fast engine and
//! puts the general engine behind the router; nothing else in the crate imports the front. The
//! browser guard is below the whole crate (`onebit_features::guard`), because both engines
//! apply it.

pub mod accept;
pub mod drain;
pub mod endpoints;
pub mod worker;
