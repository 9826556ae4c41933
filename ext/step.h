// The engine step: one native call per scheduler step. Python plans (plain data), this
// executes on the native thread:
//   boundary work (captures, clears, restores, sampler setup) while every sequence is
//   quiescent, then ONE batched draft call for every decoding sequence, ONE target batch
//   with every sequence's [tokens..., drafts...] (split by n_batch only when it must be),
//   verification with each sequence's sampler, accept, and KV rollback of rejected drafts.
#pragma once

#include "spec_session.h"

#include "sampling.h"

#include <memory>
#include <string>
#include <vector>

namespace engine {

struct SamplerParams {
    float temperature = 0.0f;  // 0 = greedy
    int32_t top_k = 0;         // 0 = whole vocabulary
    float top_p = 1.0f;
    float min_p = 0.0f;
    uint32_t seed = 0;
    int32_t penalty_last_n = 64;
    float repetition_penalty = 1.0f;
    float presence_penalty = 0.0f;
    float frequency_penalty = 0.0f;
    bool ignore_eos = false;
    std::string grammar;      // GBNF
    std::string json_schema;  // converted to GBNF by llama.cpp's common library
};

// Build a sampler (throws InvalidArgument for a malformed grammar or schema).
common_sampler_ptr make_sampler(const Model & model, const SamplerParams & params);

struct StepWork {
    int32_t seq = 0;
    std::vector<int32_t> tokens;  // appended at pos0: a prefill chunk, or [last sampled token]
    int32_t pos0 = 0;
    bool sample = false;          // sample (and verify drafts) after the last token
    int32_t n_draft = 0;          // at most this many draft tokens after `tokens`
    bool begin = false;           // the last chunk of a prompt: start the drafter's generation
};

struct StepRestore {
    int32_t seq = 0;
    std::vector<uint8_t> target, draft, spec;
};

struct StepConfigure {
    int32_t seq = 0;
    SamplerParams params;
    std::vector<int32_t> replay_prompt;     // accepted as context (penalties)
    std::vector<int32_t> replay_generated;  // accepted as generated (penalties + grammar)
};

struct StepPlan {
    std::vector<int32_t> captures;  // taken first, at the quiescent boundary
    std::vector<int32_t> clears;    // KV (target + draft), history and sampler of a slot
    std::vector<StepRestore> restores;
    std::vector<StepConfigure> configures;
    std::vector<StepWork> work;
};

struct StepOutput {
    int32_t seq = 0;
    std::vector<int32_t> tokens;      // emitted (sampled) tokens, in order
    std::vector<std::string> pieces;  // their bytes
    int32_t drafted = 0;
    int32_t accepted = 0;
    int32_t n_past = 0;               // tokens of the sequence in the KV cache afterwards
};

struct StepCapture {
    int32_t seq = 0;
    std::vector<uint8_t> target, draft, spec;
};

struct StepError {
    int32_t seq = 0;
    std::string kind;  // an engine.session.errors class name
    std::string message;
};

struct StepResult {
    std::vector<StepOutput> outputs;  // one per work item that ran
    std::vector<StepCapture> captures;
    std::vector<StepError> errors;
    int32_t n_decode_calls = 0;
    int32_t n_draft_calls = 0;
    int32_t n_batch_tokens = 0;
    int32_t n_isolated_failures = 0;
    std::string draft_error;  // the draft call failed: this step verified no drafts  // batches that failed and were retried one sequence at a time
    int64_t t_draft_us = 0, t_decode_us = 0, t_verify_us = 0, t_total_us = 0;
};

class StepRunner {
public:
    explicit StepRunner(std::shared_ptr<SpecSession> session);
    StepResult run(const StepPlan & plan);
    const std::shared_ptr<SpecSession> & session() const { return session_; }

private:
    StepResult run_unchecked(const StepPlan & plan);
    void clear_slot(int32_t seq);
    std::vector<llama_token> verify(int32_t seq, const std::vector<int> & idxs,
                                    const std::vector<llama_token> & draft);

    std::shared_ptr<SpecSession> session_;
    std::vector<common_sampler_ptr> samplers_;
    // plain greedy (temperature 0, no penalties, no grammar): verified by argmax over the
    // logits, skipping the sampler chain's full-vocabulary candidate array
    std::vector<bool> plain_greedy_;
    std::vector<bool> ignore_eos_;
};

}  // namespace engine
