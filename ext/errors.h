// Typed errors raised by the native layer. Each kind maps onto one Python exception class
// of engine.session.errors (the translator lives in nb_spec.cpp); the detail fields carry
// what the seed API's error variants carry (sequence id, sizes, reason).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace engine {

enum class ErrorKind {
    Init,                  // session / context could not be created
    ModelLoad,             // a model file could not be loaded (subclass of Init in Python)
    Process,               // common_speculative_process failed
    Begin,
    Draft,
    Accept,
    PromptTooLong,         // size, maximum
    IncompatibleContexts,  // reason
    BadSeqId,              // seq_id, n_seq
    InvalidConfig,         // reason
    InvalidArgument,       // reason (bad token id, position, batch ...)
    Decode,                // code
    ProposalPending,       // seq_id
    NoPendingProposal,     // seq_id
    AcceptedTooMany,       // accepted, proposed
    State,                 // reason
    NotQuiescent,          // seq_id (subclass of State in Python)
    Closed,                // the runtime was closed
};

struct Error : std::runtime_error {
    ErrorKind kind;
    std::string reason;
    std::optional<int64_t> seq_id, n_seq, size, maximum, accepted, proposed, code;

    Error(ErrorKind kind, std::string message, std::string reason = {})
        : std::runtime_error(std::move(message)), kind(kind), reason(std::move(reason)) {}
};

// The engine.session.errors class a kind maps onto.
inline const char * error_kind_name(ErrorKind k) {
    switch (k) {
        case ErrorKind::Init: return "InitError";
        case ErrorKind::ModelLoad: return "ModelLoadError";
        case ErrorKind::Process: return "ProcessError";
        case ErrorKind::Begin: return "BeginError";
        case ErrorKind::Draft: return "DraftError";
        case ErrorKind::Accept: return "AcceptError";
        case ErrorKind::PromptTooLong: return "PromptTooLongError";
        case ErrorKind::IncompatibleContexts: return "IncompatibleContextsError";
        case ErrorKind::BadSeqId: return "BadSeqIdError";
        case ErrorKind::InvalidConfig: return "InvalidConfigError";
        case ErrorKind::InvalidArgument: return "InvalidArgumentError";
        case ErrorKind::Decode: return "DecodeError";
        case ErrorKind::ProposalPending: return "ProposalPendingError";
        case ErrorKind::NoPendingProposal: return "NoPendingProposalError";
        case ErrorKind::AcceptedTooMany: return "AcceptedTooManyError";
        case ErrorKind::State: return "StateError";
        case ErrorKind::NotQuiescent: return "NotQuiescentError";
        case ErrorKind::Closed: return "ClosedError";
    }
    return "SessionError";
}

[[noreturn]] inline void fail(ErrorKind kind, const std::string & message) {
    throw Error(kind, message, message);
}

[[noreturn]] inline void fail_bad_seq(int64_t seq_id, int64_t n_seq) {
    Error e(ErrorKind::BadSeqId, "sequence id " + std::to_string(seq_id) + " out of range (n_seq = " +
                                     std::to_string(n_seq) + ")");
    e.seq_id = seq_id;
    e.n_seq = n_seq;
    throw e;
}

}  // namespace engine
