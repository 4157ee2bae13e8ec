//! The persistent prompt cache's series for `/metrics`: saves, restores, discards by reason,
//! evictions, bytes, and what is on disk.

use super::*;

#[derive(Default)]
pub(super) struct Counts {
    pub(super) saves: Counter,
    pub(super) restores: Counter,
    pub(super) discards: Family<ReasonLabel, Counter>,
    pub(super) saved_bytes: Counter,
    pub(super) restored_bytes: Counter,
    pub(super) evictions: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub(super) struct ReasonLabel {
    pub(super) reason: &'static str,
}

impl PromptCache {
    /// The cache's series for `/metrics` (front's scrape appends them).
    pub fn render(&self) -> String {
        let mut registry = Registry::default();
        registry.register(
            "onebit_prompt_cache_saves",
            "KV states the persistent prompt cache saved to disk",
            self.counts.saves.clone(),
        );
        registry.register(
            "onebit_prompt_cache_restores",
            "KV states the persistent prompt cache restored into a slot",
            self.counts.restores.clone(),
        );
        for reason in Reason::ALL {
            let _ = self.counts.discards.get_or_create(&ReasonLabel {
                reason: reason.label(),
            });
        }
        registry.register(
            "onebit_prompt_cache_discards",
            "State files the persistent prompt cache discarded, by reason",
            self.counts.discards.clone(),
        );
        registry.register(
            "onebit_prompt_cache_evictions",
            "States removed to keep the budget, or replaced by a longer one",
            self.counts.evictions.clone(),
        );
        registry.register(
            "onebit_prompt_cache_saved_bytes",
            "Bytes of the states saved",
            self.counts.saved_bytes.clone(),
        );
        registry.register(
            "onebit_prompt_cache_restored_bytes",
            "Bytes of the states restored",
            self.counts.restored_bytes.clone(),
        );
        let (bytes, entries) = self
            .store
            .lock()
            .ok()
            .and_then(|s| s.as_ref().map(|s| (s.total_bytes(), s.count())))
            .unwrap_or((0, 0));
        let on_disk = Gauge::<i64>::default();
        on_disk.set(i64::try_from(bytes).unwrap_or(i64::MAX));
        registry.register(
            "onebit_prompt_cache_disk_bytes",
            "Bytes of the states on disk",
            on_disk,
        );
        let held = Gauge::<i64>::default();
        held.set(entries as i64);
        registry.register(
            "onebit_prompt_cache_states",
            "States on disk this serve can restore",
            held,
        );
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode_registry(&mut out, &registry);
        // Strict 0.0.4 as the rest of serve's text: a counter's HELP and TYPE under its
        // `_total` name, no `# EOF`.
        onebit_metrics::text::strict_004(&out)
    }
}
