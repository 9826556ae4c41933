// The engine step: one native call per scheduler step. Python plans (plain data), this
// executes on the native thread, in named phases:
//
//   settle    the previous step's verifications, as Python decided from their tokens: each
//             sequence accepts the drafts it keeps and drops the KV rows after them (a stop
//             inside accepted drafts keeps exactly the tokens its caller saw)
//   boundary  every sequence is quiescent now: drafters begin on finished prompts, then
//             captures, parked samplers, clears, prefix reuses, restores and samplers
//   draft     ONE batched draft call for every decoding sequence
//   decode    ONE target batch with every sequence's [tokens..., drafts...] (split by
//             n_batch only when it must be), then verification with each sequence's sampler
//
// Verified drafts stay pending until the next step's settle phase: Python sees the tokens
// first and decides how many of them the sequence keeps.
#pragma once

#include "sampler.h"
#include "spec_session.h"

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace engine {

struct StepWork {
    int32_t seq = 0;
    std::vector<int32_t> tokens;  // appended at pos0: a prefill chunk, or [last sampled token]
    int32_t pos0 = 0;
    bool sample = false;          // sample (and verify drafts) after the last token
    int32_t n_draft = 0;          // at most this many draft tokens after `tokens`
    int32_t max_draft = 0;        // draft rows it may take, fillers included (see output_align)
    bool begin = false;           // the last chunk of a prompt: start the drafter's generation
    // Draft this many (at least n_draft) and return the whole draft (StepOutput::shadow),
    // to be compared with the tokens the sequence emits (free evidence of what drafting
    // longer would bring): only its first n_draft are verified (can_shadow).
    int32_t shadow = 0;
};

struct StepRestore {
    int32_t seq = 0;
    SequenceState state;
};

struct StepConfigure {
    int32_t seq = 0;
    SamplerParams params;
    std::vector<int32_t> replay_prompt;     // accepted as context (penalties)
    std::vector<int32_t> replay_generated;  // accepted as generated (penalties + grammar)
};

struct StepReuse {
    int32_t seq = 0;
    std::vector<int32_t> prefix;  // what the sequence keeps: a new request's prompt starts with it
};

struct StepPark {
    int32_t seq = 0;
    uint64_t key = 0;  // the caller's name for the parked sampler
};

struct StepSettle {
    int32_t seq = 0;
    int32_t n_accepted = 0;  // drafts the sequence keeps, <= what verification accepted
};

struct StepPlan {
    // CPU matmul kernels take the output rows in tiles: a batch whose rows that need logits
    // are not a multiple of `output_align` pays for the partial tile almost as for a whole
    // one. From `align_from` rows on, drafts are padded with filler tokens (the last draft
    // token again) up to the next multiple: free rows, sometimes accepted.
    int32_t output_align = 1;
    int32_t align_from = 0;
    // A stream drafter (EAGLE-3, DFlash, MTP) reads this step's batch: off when keeping it in
    // sync costs more than its drafts bring (every sequence in the batch falls out of sync)
    bool sync_drafter = true;
    std::vector<StepSettle> settles;  // sequences not named keep every verified token
    std::vector<int32_t> captures;    // taken at the quiescent boundary
    std::vector<int32_t> clears;      // KV (target + draft), history and sampler of a slot
    std::vector<StepPark> parks;      // a preempted sequence's sampler set aside (after captures)
    std::vector<StepReuse> reuses;    // cut back to a prefix a new request shares (after clears)
    std::vector<StepRestore> restores;
    std::vector<StepConfigure> configures;
    std::vector<StepPark> unparks;    // a parked sampler back on a (restored) sequence
    std::vector<uint64_t> drops;      // parked samplers nobody will take back
    std::vector<StepWork> work;
};

struct StepOutput {
    int32_t seq = 0;
    std::vector<int32_t> tokens;      // verified tokens: accepted drafts, then the target's own
    std::vector<std::string> pieces;  // their bytes
    int32_t drafted = 0;              // draft rows verified
    int32_t produced = 0;             // drafts the drafter produced (before any trim)
    int32_t accepted = 0;             // drafts verification accepted (tokens.size() - 1)
    bool in_sync = true;              // the drafter can draft for the sequence (see sync_drafter)
    std::vector<int32_t> shadow;      // the shadow draft (StepWork::shadow), not verified
    std::vector<TokenLogprobs> logprobs;  // per token, when its request asked for them
};

struct StepCapture {
    int32_t seq = 0;
    SequenceState state;
};

struct StepError {
    int32_t seq = 0;
    std::string kind;  // an engine.session.errors class name
    std::string message;
};

struct StepResult {
    std::vector<StepOutput> outputs;  // one per sampling work item that ran
    std::vector<StepCapture> captures;
    std::vector<StepError> errors;
    int32_t n_decode_calls = 0;
    int32_t n_draft_calls = 0;
    int32_t n_batch_tokens = 0;
    int32_t n_isolated_failures = 0;  // batches that failed and were retried one sequence at a time
    std::string draft_error;          // the draft call failed: this step verified no drafts
    int64_t t_draft_us = 0, t_decode_us = 0, t_total_us = 0;
    int64_t t_process_us = 0;  // the drafter's share of t_decode_us (its own pass over the batch)
    int64_t t_catch_up_us = 0;  // a draft model decoding the history it skipped (not in t_draft_us)
    int32_t n_sync_tokens = 0;  // rows the drafter decoded to keep up (processed or caught up)
};

class StepRunner {
public:
    explicit StepRunner(std::shared_ptr<SpecSession> session);
    StepResult run(const StepPlan & plan);

private:
    struct State;  // one step's working data
    // A verification whose outcome Python has not seen yet.
    struct Unsettled {
        int32_t pos_last = 0;  // position of the last input token (the first verified row)
        int32_t n_accepted = 0;
        bool begin = false;    // the prompt ended here: start the drafter's generation
    };

    void settle(State & st);
    void boundary(State & st);
    void select_work(State & st);
    void draft(State & st);
    void align_rows(State & st);
    void decode(State & st);
    bool decode_and_verify(State & st, const std::vector<const StepWork *> & items);
    void fail_seq(State & st, int32_t seq, const std::exception & e);
    void clear_slot(int32_t seq);

    std::shared_ptr<SpecSession> session_;
    std::vector<std::optional<SequenceSampler>> samplers_;
    std::vector<std::optional<Unsettled>> unsettled_;
    // samplers of preempted sequences (grammar, penalties and RNG as they were): a resumed
    // sequence samples exactly what it would have without the preemption
    std::unordered_map<uint64_t, SequenceSampler> parked_;
};

}  // namespace engine
