//! llama.cpp's log lines: the buffer sizes kept for /metrics, every line dropped from stderr.
// The callback llama.cpp calls is an `unsafe extern "C" fn` reading the C string it is given.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_void};

/// The buffers llama.cpp said it allocated (its `... buffer size = N MiB` lines), by kind
/// (`model`, `KV`, `compute`, `output`), until a session takes them.
pub(super) static BUFFERS: std::sync::Mutex<Vec<(String, u64)>> = std::sync::Mutex::new(Vec::new());

/// llama.cpp's log callback: keeps the buffer sizes and drops every line (its many lines on
/// stderr would be taken for serve's own, and every failure the route meets reaches the user
/// as a one-line error anyway).
pub(super) unsafe extern "C" fn keep_buffer_sizes(
    _level: c_int,
    text: *const c_char,
    _data: *mut c_void,
) {
    if text.is_null() {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated line that lives for the call.
    let line = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    if let Some(buffer) = buffer_size(&line) {
        BUFFERS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buffer);
    }
}

/// `load_tensors:   CPU_Mapped model buffer size =    90.00 MiB` → (`model`, bytes).
pub fn buffer_size(line: &str) -> Option<(String, u64)> {
    let (before, after) = line.split_once(" buffer size =")?;
    let kind = before.split_whitespace().last()?.to_string();
    let mut words = after.split_whitespace();
    let value: f64 = words.next()?.parse().ok()?;
    let scale = match words.next()? {
        "MiB" => 1024.0 * 1024.0,
        "KiB" => 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "B" => 1.0,
        _ => return None,
    };
    Some((kind, (value * scale).round() as u64))
}

#[cfg(test)]
mod tests {
    #[test]
    fn buffer_sizes_are_read_from_llama_cpps_lines() {
        let read = super::buffer_size;
        assert_eq!(
            read("load_tensors:   CPU_Mapped model buffer size =    90.00 MiB\n"),
            Some(("model".to_string(), 94_371_840))
        );
        assert_eq!(
            read("llama_kv_cache:        CPU KV buffer size =    22.50 MiB"),
            Some(("KV".to_string(), 23_592_960))
        );
        assert_eq!(
            read("llama_context:        CPU  output buffer size =     0.19 MiB"),
            Some(("output".to_string(), 199_229))
        );
        assert_eq!(read("llama_context: n_ctx = 2048"), None);
        assert_eq!(read("x buffer size = lots MiB"), None);
    }
}
