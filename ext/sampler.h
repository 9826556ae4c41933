// Per-sequence sampling and draft verification. One set of rules for the sampling
// parameters (validate_sampler_params), used by Python before a request is queued and by
// the step before a sampler is built.
#pragma once

#include "model.h"

#include "sampling.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace engine {

// A grammar trigger of a lazy grammar, resolved against the vocabulary.
struct ChatTrigger {
    int32_t type = 0;  // common_grammar_trigger_type
    std::string value;
    int32_t token = -1;
};

// What the template asks of the sampler: its grammar (tool calls, or the content's schema
// after the thinking), lazy until a trigger appears, the tokens it keeps whole, and the
// thinking tags (inside them the grammar does not apply).
struct ChatGrammar {
    std::string grammar;  // GBNF, empty: none
    bool lazy = false;
    std::vector<ChatTrigger> triggers;
    std::vector<int32_t> preserved_tokens;
    std::string generation_prompt;  // what the template put before the answer (prefilled into the grammar)
    std::vector<int32_t> thinking_start;
    std::vector<std::vector<int32_t>> thinking_end;
};

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
    std::vector<std::pair<int32_t, float>> logit_bias;  // added to a token's logit (-inf bans it)
    int32_t n_logprobs = -1;  // -1: none; k >= 0: each emitted token's logprob and the top k
    int32_t min_tokens = 0;   // end-of-generation and min_tokens_suppress tokens are banned before this many
    std::vector<int32_t> min_tokens_suppress;  // (the request's stop token ids)
    ChatGrammar chat;         // a chat template's grammar (tool calls), instead of grammar / json_schema
    bool special = false;     // render special tokens as text (besides the chat grammar's preserved ones)
};

// The most log-probabilities a request may ask for per token (OpenAI's top_logprobs bound).
constexpr int32_t MAX_LOGPROBS = 20;

// One emitted token's log-probability under the target's distribution (the log-softmax of
// the raw logits at its position, before any sampling transform), and the k most likely.
struct Candidate {
    int32_t token = 0;
    float logprob = 0.0f;
    std::string piece;  // its bytes
};

struct TokenLogprobs {
    float logprob = 0.0f;
    std::vector<Candidate> top;  // most likely first
};

// TokenLogprobs of `token` in one row of `model`'s logits; O(n_vocab) with a k-entry selection.
TokenLogprobs token_logprobs(const Model & model, const float * logits, llama_token token, int32_t k);

// InvalidConfig naming the first bad value. Grammars are checked when the sampler is built.
void validate_sampler_params(const SamplerParams & params);

// One sequence's sampler: llama.cpp's sampler chain, or plain argmax for greedy requests
// without penalties or grammar (the chain's full-vocabulary candidate array costs several times
// more on a large vocabulary and gives the same token).
class SequenceSampler {
public:
    // InvalidConfig for bad values, InvalidArgument for a malformed grammar or JSON schema.
    SequenceSampler(const Model & model, const SamplerParams & params);

    // Tell the sampler about tokens already in the sequence (penalties, grammar state).
    void replay(const std::vector<llama_token> & prompt, const std::vector<llama_token> & generated);

    // Sample at each row of `rows` (the last input token, then each draft token) and keep
    // drafts while they equal the sample: returns the samples, at least one. Every sample
    // is a sample of the target distribution, so drafting never changes what is generated.
    std::vector<llama_token> verify(llama_context * ctx, const std::vector<int> & rows,
                                    const std::vector<llama_token> & draft);

    int32_t n_logprobs() const { return n_logprobs_; }
    // Whether a token's text is rendered with its special form (a template's preserved
    // tokens, such as <tool_call>, and every special token when the request asks so).
    bool renders_special(llama_token token) const {
        return special_ || std::binary_search(preserved_.begin(), preserved_.end(), token);
    }

private:
    llama_token argmax(const float * logits) const;

    void suppress_early_stops(llama_context * ctx, const std::vector<int> & rows) const;

    common_sampler_ptr chain_;
    int32_t n_vocab_ = 0;
    int32_t min_tokens_ = 0;
    int32_t n_generated_ = 0;             // tokens verified so far (min_tokens counts them)
    std::vector<llama_token> early_stops_;  // banned while n_generated_ < min_tokens_
    std::vector<llama_token> eog_;  // end-of-generation tokens, excluded under ignore_eos
    bool plain_greedy_ = false;
    bool ignore_eos_ = false;
    int32_t n_logprobs_ = -1;
    bool special_ = false;
    std::vector<llama_token> preserved_;  // sorted
};

}  // namespace engine
