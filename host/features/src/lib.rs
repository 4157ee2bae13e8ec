//! What acts on requests, each plugged into the relay's phases (`onebit_relay::exchange`):
//! the browser guard and the API key ([`guard`], phase 1), the persistent prompt cache
//! ([`prompt_cache`], phase 4 and the end), `--pm`'s tool loop ([`pm`], a plan's target) and
//! `--laya`'s device choice ([`laya`], a plan's backend). Uses `onebit-command`,
//! `onebit-supervision` and `onebit-metrics`; knows nothing of the relay's engines.
#![forbid(unsafe_code)]

pub mod guard;
pub mod laya;
pub mod pm;
pub mod prompt_cache;
