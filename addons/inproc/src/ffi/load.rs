//! Loading llama.cpp: its four libraries opened in order and every function resolved.
// Opening a library and calling through its resolved pointers are `unsafe`.
#![allow(unsafe_code)]

use std::ffi::CStr;
use std::path::PathBuf;

use libloading::Library;

use super::abi::Functions;
use super::log::keep_buffer_sizes;
use super::{LIBRARIES, Llama};
use crate::error::InprocError;

/// Resolves one symbol into a typed function pointer.
macro_rules! symbol {
    ($lib:expr, $name:literal) => {{
        // SAFETY: the type the caller binds this to is the function's signature in the
        // pinned llama.h; `Library::get` checks only that the symbol exists.
        let found = unsafe { $lib.get(concat!($name, "\0").as_bytes()) };
        *found
            .map_err(|e| InprocError::Engine(format!("{} lacks {}: {e}", "libllama.so", $name)))?
    }};
}

impl Llama {
    /// Load the four libraries, `files` in [`LIBRARIES`]' order (a dependency before what
    /// needs it, so a build of one under another file name, a package's variant, is the one its
    /// dependants find by soname), and resolve every function the route uses. Called by the
    /// route's `start` on the host's thread; blocks for the loading (milliseconds). An error is
    /// one line naming the missing file or symbol.
    pub fn load(files: &[PathBuf]) -> Result<Llama, InprocError> {
        debug_assert_eq!(files.len(), LIBRARIES.len());
        let mut libraries = Vec::new();
        for path in files {
            // SAFETY: loading runs the library's initialisers; these are llama.cpp's own
            // libraries built by setup from the pinned source, whose initialisers only set up
            // ggml's tables.
            let library = unsafe { Library::new(path) }
                .map_err(|e| InprocError::Engine(format!("cannot load {}: {e}", path.display())))?;
            libraries.push(library);
        }
        let llama = libraries.last().expect("libllama is loaded last");
        let functions = Functions {
            backend_init: symbol!(llama, "llama_backend_init"),
            model_default_params: symbol!(llama, "llama_model_default_params"),
            context_default_params: symbol!(llama, "llama_context_default_params"),
            model_load_from_file: symbol!(llama, "llama_model_load_from_file"),
            model_free: symbol!(llama, "llama_model_free"),
            init_from_model: symbol!(llama, "llama_init_from_model"),
            free: symbol!(llama, "llama_free"),
            n_batch: symbol!(llama, "llama_n_batch"),
            n_ubatch: symbol!(llama, "llama_n_ubatch"),
            n_ctx_seq: symbol!(llama, "llama_n_ctx_seq"),
            batch_init: symbol!(llama, "llama_batch_init"),
            model_get_vocab: symbol!(llama, "llama_model_get_vocab"),
            model_chat_template: symbol!(llama, "llama_model_chat_template"),
            model_meta_val_str: symbol!(llama, "llama_model_meta_val_str"),
            get_memory: symbol!(llama, "llama_get_memory"),
            memory_seq_rm: symbol!(llama, "llama_memory_seq_rm"),
            memory_seq_pos_min: symbol!(llama, "llama_memory_seq_pos_min"),
            state_seq_get_size: symbol!(llama, "llama_state_seq_get_size"),
            state_seq_get_data: symbol!(llama, "llama_state_seq_get_data"),
            state_seq_set_data: symbol!(llama, "llama_state_seq_set_data"),
            model_n_swa: symbol!(llama, "llama_model_n_swa"),
            tokenize: symbol!(llama, "llama_tokenize"),
            token_to_piece: symbol!(llama, "llama_token_to_piece"),
            vocab_is_eog: symbol!(llama, "llama_vocab_is_eog"),
            vocab_bos: symbol!(llama, "llama_vocab_bos"),
            vocab_eos: symbol!(llama, "llama_vocab_eos"),
            decode: symbol!(llama, "llama_decode"),
            sampler_chain_default_params: symbol!(llama, "llama_sampler_chain_default_params"),
            sampler_chain_init: symbol!(llama, "llama_sampler_chain_init"),
            sampler_chain_add: symbol!(llama, "llama_sampler_chain_add"),
            sampler_init_greedy: symbol!(llama, "llama_sampler_init_greedy"),
            sampler_init_dist: symbol!(llama, "llama_sampler_init_dist"),
            sampler_init_top_k: symbol!(llama, "llama_sampler_init_top_k"),
            sampler_init_top_p: symbol!(llama, "llama_sampler_init_top_p"),
            sampler_init_min_p: symbol!(llama, "llama_sampler_init_min_p"),
            sampler_init_temp: symbol!(llama, "llama_sampler_init_temp"),
            sampler_sample: symbol!(llama, "llama_sampler_sample"),
            sampler_free: symbol!(llama, "llama_sampler_free"),
            print_system_info: symbol!(llama, "llama_print_system_info"),
            log_set: symbol!(llama, "llama_log_set"),
        };
        // SAFETY: both take no arguments; llama_backend_init is documented as "call once at
        // the start", which `load` is (the route loads llama.cpp once per process).
        // llama_log_set stores the callback (a function that lives as long as this library,
        // and reads only the line it is given) for ggml and llama.cpp alike.
        unsafe {
            (functions.log_set)(Some(keep_buffer_sizes), std::ptr::null_mut());
            (functions.backend_init)();
        }
        Ok(Llama {
            functions,
            _libraries: libraries,
        })
    }

    /// `llama_print_system_info`: the CPU features ggml was built for, one line.
    pub fn system_info(&self) -> String {
        // SAFETY: returns a pointer to a static NUL-terminated buffer inside the library.
        let text = unsafe { CStr::from_ptr((self.functions.print_system_info)()) };
        text.to_string_lossy().trim().to_string()
    }
}
