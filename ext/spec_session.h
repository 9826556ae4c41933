// The speculative session: upstream common_speculative behind the seed API's lifecycle
// rules (begin / process / draft / accept, quiescence, per-sequence state). Every method
// runs on the executor's native thread; every rule is checked before llama.cpp is called.
#pragma once

#include "model.h"

#include "speculative.h"

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace engine {

inline int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

struct SpecConfig {
    std::string type = "none";  // none, draft-simple, draft-eagle3, draft-dflash, draft-dspark,
                                // draft-mtp, ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache
    uint32_t n_seq = 1;
    int32_t n_draft_max = 3;    // upstream default n_max
    int32_t n_min = 0;          // upstream default
    float p_min = 0.0f;         // upstream default
    bool backend_sampling = true;
    // n-gram drafters (ngram-simple / ngram-map-k / ngram-map-k4v): key and draft lengths
    int32_t ngram_size_n = 12;
    int32_t ngram_size_m = 48;
    int32_t ngram_min_hits = 1;
};

// Upstream's speculative type names, in one place (Python reads them from here).
const std::vector<std::string> & spec_types();
// Validate a config alone (InvalidConfig); also used by Python before any context exists.
void validate_spec_config(const SpecConfig & config);
// "" when a context of `n_batch` tokens can verify a sequence's longest draft under `config`
// ([id_last, d1..dk]: n_draft_max + 1 tokens), else why; for the target and the draft context.
std::string spec_batch_error(const SpecConfig & config, int64_t n_batch);
// What a speculative state is valid for: every field of the config.
uint32_t spec_config_digest(const SpecConfig & config);
bool spec_type_needs_draft_model(const std::string & type);  // draft-simple / eagle3 / dflash / dspark
bool spec_type_is_mtp(const std::string & type);

// How a drafter keeps up with what the target decodes (see SpecSession::sync).
enum class DrafterSync {
    None,     // n-gram drafters (and none): they read the token history, nothing to decode
    CatchUp,  // a draft model: it decodes the history it has not seen right before it drafts
    Stream,   // hidden-state drafters (EAGLE-3, DFlash, MTP): they read the target's hidden
              // states of each batch as it is decoded; a batch they skip is lost to them
};

struct DraftRequest {
    int32_t seq_id;
    int32_t n_past;
    int32_t id_last;
    int32_t n_max;  // -1: the configured n_draft_max
    // How many of the drafted tokens are proposed for verification (-1: all). The rest is
    // drafted in shadow, only to be compared with what the target emits later: no proposal
    // is left pending for it, nothing counted (0: a shadow draft). Only a drafter whose state
    // does not follow what is verified may propose fewer than it drafts (can_shadow).
    int32_t n_propose = -1;
};

// One sequence's whole state, captured at a quiescent point: target and draft KV (llama.cpp
// sequence state) and the speculative container (history + the drafter's own state).
struct SequenceState {
    std::vector<uint8_t> target, draft, spec;
};

struct SpecStats {
    uint64_t n_begin = 0, n_process = 0, n_draft_calls = 0, n_drafts = 0, n_drafted = 0;
    uint64_t n_accept_calls = 0, n_accepted = 0;
    std::vector<uint64_t> accepted_per_pos;
    int64_t t_process_us = 0, t_draft_us = 0, t_accept_us = 0;
    uint64_t n_caught_up = 0;  // tokens a catch-up drafter decoded before drafting
    int64_t t_catch_up_us = 0;
};

class SpecSession {
public:
    SpecSession(std::shared_ptr<Context> target, std::shared_ptr<Context> draft, const SpecConfig & config);
    ~SpecSession();
    SpecSession(const SpecSession &) = delete;
    SpecSession & operator=(const SpecSession &) = delete;

    const SpecConfig & config() const { return config_; }
    const std::shared_ptr<Context> & target() const { return target_; }
    const std::shared_ptr<Context> & draft_context() const { return draft_; }
    // Which hidden states the drafter asked the target context for (observed at init).
    bool need_embd() const { return need_embd_; }
    bool need_embd_pre_norm() const { return need_embd_pre_norm_; }

    void decode_target(const BatchData & batch);
    void process(const BatchData & batch);
    // "none", "catch_up" or "stream" (Python's engine.scheduler.policy.DrafterSync values)
    std::string drafter_sync() const;
    // The engine step's process(): the batch just decoded on the target goes into the
    // history, and the drafter keeps up only as far as it must. A catch-up drafter decodes
    // nothing now (catch_up does, for the sequences that draft). A stream drafter processes
    // the batch when `stream` is set; otherwise every sequence in it is out of sync from now
    // on (it drafts nothing until the sequence is cleared). Returns the rows the drafter
    // decoded.
    int32_t sync(const BatchData & batch, bool stream);
    // Whether the drafter can draft for the sequence (a stream drafter that missed a batch of
    // it cannot).
    bool in_sync(int32_t seq_id) const { return in_sync_.at(seq_id); }
    // A stream drafter's hidden states are extracted from the target's decodes only while it
    // is fed (sync with `stream`): the step switches them before its decode.
    void set_streaming(bool on);
    void begin(int32_t seq_id, const std::vector<llama_token> & prompt);
    std::vector<llama_token> draft(int32_t seq_id, int32_t n_past, llama_token id_last);
    // Throws what draft_many would throw for this request alone (bad id, pending, n_past).
    void check_draft_request(const DraftRequest & r) const;
    // One upstream draft call for many sequences; result i belongs to requests[i].
    std::vector<std::vector<llama_token>> draft_many(const std::vector<DraftRequest> & requests);
    // Whether the drafter may draft in shadow (DraftRequest::n_propose): ngram-simple, whose
    // drafts are a pure function of the history and whose accept does nothing.
    bool can_shadow() const { return config_.type == "ngram-simple"; }
    void accept(int32_t seq_id, int64_t n_accepted);
    // Lengthen a pending proposal by tokens the caller appended to the draft (fillers that
    // verification may accept; upstream accept indexes the verified rows, which hold them).
    void extend_proposal(int32_t seq_id, int32_t n);

    // No pending proposal on any sequence, and no draft call left unfinished upstream.
    bool is_quiescent() const;
    std::optional<int32_t> pending(int32_t seq_id) const;
    void print_stats() const;
    const SpecStats & stats() const { return stats_; }

    // The seed's per-sequence speculative state: State error when the drafter keeps none.
    std::vector<uint8_t> speculative_state(int32_t seq_id);
    void restore_speculative_state(int32_t seq_id, const std::vector<uint8_t> & state);
    // Whole-sequence capture and restore (checkpoints, preemption). Restore validates the
    // speculative container before anything changes; a failure leaves the sequence empty.
    SequenceState capture_sequence(int32_t seq_id);
    void restore_sequence(int32_t seq_id, const SequenceState & state);

    bool clear_target_kv(int64_t seq_id, int64_t p0, int64_t p1);
    bool clear_draft_kv(int64_t seq_id, int64_t p0, int64_t p1);
    void clear_sequence(int32_t seq_id);  // target and draft KV and the history of one sequence
    // Prefix reuse: keep the first prefix.size() positions of a sequence (target and draft KV,
    // history) and drop the rest. InvalidArgument unless the history starts with `prefix`;
    // State when the memory cannot be cut there (recurrent state, or a sliding window that
    // no longer holds the positions before the cut). Nothing changes when it throws.
    void keep_prefix(int32_t seq_id, const std::vector<llama_token> & prefix);

    // Tokens the session knows to be in the target context for a sequence (by position).
    const std::vector<llama_token> & history(int32_t seq_id) const { return history_.at(seq_id); }

    void check_seq(int64_t seq_id) const;
    // NoPendingProposal ("... has no draft proposal to <verb>") unless seq_id has one.
    void require_proposal(int32_t seq_id, const char * verb) const;
    // ProposalPending naming the first sequence with a pending proposal; NotQuiescent when
    // upstream is still in a draft call.
    void require_quiescent() const;

private:
    bool upstream_quiescent() const;
    void process_checks(const BatchData & batch);  // validate, record the history
    // A catch-up drafter decodes the history it has not seen of each requested sequence, up
    // to its n_past, in batches of the draft context's n_batch (draft_many calls it first).
    void catch_up(const std::vector<DraftRequest> & requests);
    void validate_contexts();
    void record_history(const BatchData & batch);
    std::vector<uint8_t> spec_container(int32_t seq_id, bool require_payload);
    struct ParsedState {
        std::vector<llama_token> history;
        bool has_payload = false;
        std::vector<uint8_t> payload;
    };
    ParsedState parse_spec_container(const std::vector<uint8_t> & state) const;
    void apply_spec_state(int32_t seq_id, ParsedState parsed);

    std::shared_ptr<Context> target_;
    std::shared_ptr<Context> draft_;
    SpecConfig config_;
    common_speculative * spec_ = nullptr;
    std::vector<int32_t> pending_;                 // -1: no proposal pending
    std::vector<std::vector<llama_token>> history_;
    std::vector<std::vector<llama_token>> results_;  // upstream writes drafts here
    DrafterSync sync_kind_ = DrafterSync::None;
    std::vector<bool> in_sync_;  // per sequence (a stream drafter that skipped a batch: false)
    Context::PreNorm streamed_;  // the target's hidden states a stream drafter reads
    bool streaming_ = true;
    SpecStats stats_;
    bool need_embd_ = false, need_embd_pre_norm_ = false;
};

}  // namespace engine
