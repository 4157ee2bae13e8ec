//! The front door: serve's listening socket (`accept`) and serve's own routes with the axum
//! router around the general engine (`endpoints`, and `worker`: what a gateway asks of a worker),
//! and the drain on SIGTERM that says so on `/health`, stops accepting and waits for the
//! requests in flight (`drain`).
//!
//! The front sits above the relay in the order of the rooms: it hands each connection to the
//! relay's fast engine and puts the general engine behind the router; the relay never imports
//! the front. The browser guard is a room of its own below both, because both engines apply
//! it (`onebit_features::guard`).

pub mod accept;
pub mod drain;
pub mod endpoints;
pub mod worker;
