//! The front door: what every client request meets before it is relayed.
//!
//! The browser guard (Host and Origin, judged before any routing) lives here. It sits above
//! the relay in the order of the rooms: the front may use the relay, never the other way.

pub mod accept;
pub mod own;
