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

// Validate a config alone (InvalidConfig); also used by Python before any context exists.
void validate_spec_config(const SpecConfig & config);
bool spec_type_needs_draft_model(const std::string & type);  // draft-simple / eagle3 / dflash / dspark
bool spec_type_is_mtp(const std::string & type);

struct DraftRequest {
    int32_t seq_id;
    int32_t n_past;
    int32_t id_last;
    int32_t n_max;  // -1: the configured n_draft_max
};

struct SpecStats {
    uint64_t n_begin = 0, n_process = 0, n_draft_calls = 0, n_drafts = 0, n_drafted = 0;
    uint64_t n_accept_calls = 0, n_accepted = 0;
    std::vector<uint64_t> accepted_per_pos;
    int64_t t_process_us = 0, t_draft_us = 0, t_accept_us = 0;
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
    bool need_embd() const { return false; }
    bool need_embd_pre_norm() const;

    void decode_target(const BatchData & batch);
    void process(const BatchData & batch);
    void begin(int32_t seq_id, const std::vector<llama_token> & prompt);
    std::vector<llama_token> draft(int32_t seq_id, int32_t n_past, llama_token id_last);
    // Throws what draft_many would throw for this request alone (bad id, pending, n_past).
    void check_draft_request(const DraftRequest & r) const;
    // One upstream draft call for many sequences; result i belongs to requests[i].
    std::vector<std::vector<llama_token>> draft_many(const std::vector<DraftRequest> & requests);
    void accept(int32_t seq_id, int64_t n_accepted);

    bool is_quiescent() const;
    std::optional<int32_t> pending(int32_t seq_id) const;
    void print_stats() const;
    const SpecStats & stats() const { return stats_; }

    std::vector<uint8_t> speculative_state(int32_t seq_id);
    void restore_speculative_state(int32_t seq_id, const std::vector<uint8_t> & state);

    bool clear_target_kv(int64_t seq_id, int64_t p0, int64_t p1);
    bool clear_draft_kv(int64_t seq_id, int64_t p0, int64_t p1);

    // Tokens the session knows to be in the target context for a sequence (by position).
    const std::vector<llama_token> & history(int32_t seq_id) const { return history_.at(seq_id); }

    void check_seq(int64_t seq_id) const;
    void require_quiescent() const;

private:
    void validate_contexts();
    void record_history(const BatchData & batch);

    std::shared_ptr<Context> target_;
    std::shared_ptr<Context> draft_;
    SpecConfig config_;
    common_speculative * spec_ = nullptr;
    std::vector<int32_t> pending_;                 // -1: no proposal pending
    std::vector<std::vector<llama_token>> history_;
    std::vector<std::vector<llama_token>> results_;  // upstream writes drafts here
    SpecStats stats_;
};

}  // namespace engine
