//! Scripts of requests to every RPC of an in-process salusd on the cpu device, through
//! its real gRPC services; crashes are panics, `INTERNAL` answers, hangs and anything left
//! behind once the clients have gone (`salus_fuzz::rpc`).
#![no_main]

libfuzzer_sys::fuzz_target!(|script: salus_fuzz::rpc::Script| {
    salus_fuzz::rpc::run(&script);
});
