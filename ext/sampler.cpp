#include "sampler.h"

#include "json-schema-to-grammar.h"
#include "json.h"

#include "argmax.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace engine {

void validate_sampler_params(const SamplerParams & sp) {
    auto bad = [](const std::string & why) { fail(ErrorKind::InvalidConfig, why); };
    auto number = [](float v) { return std::to_string(v); };
    if (!std::isfinite(sp.temperature) || sp.temperature < 0.0f) bad("temperature must be >= 0, got " + number(sp.temperature));
    if (sp.top_k < 0) bad("top_k must be >= 0, got " + std::to_string(sp.top_k));
    if (!(sp.top_p > 0.0f && sp.top_p <= 1.0f)) bad("top_p must be in (0, 1], got " + number(sp.top_p));
    if (!(sp.min_p >= 0.0f && sp.min_p <= 1.0f)) bad("min_p must be in [0, 1], got " + number(sp.min_p));
    if (sp.penalty_last_n < -1) bad("penalty_last_n must be >= -1, got " + std::to_string(sp.penalty_last_n));
    if (!std::isfinite(sp.repetition_penalty) || sp.repetition_penalty <= 0.0f) {
        bad("repetition_penalty must be > 0, got " + number(sp.repetition_penalty));
    }
    if (!std::isfinite(sp.presence_penalty)) bad("presence_penalty must be finite");
    if (!std::isfinite(sp.frequency_penalty)) bad("frequency_penalty must be finite");
    if (!sp.grammar.empty() && !sp.json_schema.empty()) bad("give a grammar or a json_schema, not both");
    if (sp.n_logprobs < -1 || sp.n_logprobs > MAX_LOGPROBS) {
        bad("logprobs must be in [0, " + std::to_string(MAX_LOGPROBS) + "], got " + std::to_string(sp.n_logprobs));
    }
    for (const auto & [token, bias] : sp.logit_bias) {
        if (token < 0) bad("logit_bias token ids must be >= 0, got " + std::to_string(token));
        if (std::isnan(bias) || bias == std::numeric_limits<float>::infinity()) {
            bad("logit_bias values must be finite or -inf, got " + number(bias));
        }
    }
}

TokenLogprobs token_logprobs(const Model & model, const float * logits, llama_token token, int32_t k) {
    const int32_t n_vocab = model.info().n_vocab;
    float max = -std::numeric_limits<float>::infinity();
    for (int32_t t = 0; t < n_vocab; ++t) max = std::max(max, logits[t]);
    double sum = 0.0;
    for (int32_t t = 0; t < n_vocab; ++t) sum += std::exp(static_cast<double>(logits[t] - max));
    const float lse = max + static_cast<float>(std::log(sum));
    TokenLogprobs out;
    out.logprob = logits[token] - lse;
    if (k <= 0) return out;
    // the k largest logits: a min-heap of k (token, logit), one pass over the vocabulary
    using Entry = std::pair<int32_t, float>;
    auto greater = [](const Entry & a, const Entry & b) {
        return a.second > b.second || (a.second == b.second && a.first < b.first);
    };
    std::vector<Entry> heap;
    heap.reserve(k + 1);
    for (int32_t t = 0; t < n_vocab; ++t) {
        if (static_cast<int32_t>(heap.size()) == k && !greater({t, logits[t]}, heap.front())) continue;
        heap.emplace_back(t, logits[t]);
        std::push_heap(heap.begin(), heap.end(), greater);
        if (static_cast<int32_t>(heap.size()) > k) {
            std::pop_heap(heap.begin(), heap.end(), greater);
            heap.pop_back();
        }
    }
    std::sort(heap.begin(), heap.end(), greater);
    for (const auto & [t, logit] : heap) out.top.push_back({t, logit - lse, model.token_to_piece(t, false)});
    return out;
}

namespace {

bool is_plain_greedy(const SamplerParams & p) {
    return p.temperature <= 0.0f && p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f &&
           p.frequency_penalty == 0.0f && p.grammar.empty() && p.json_schema.empty() && p.logit_bias.empty();
}

common_sampler_ptr make_chain(const Model & model, const SamplerParams & sp) {
    auto bad = [](const std::string & why) { fail(ErrorKind::InvalidArgument, why); };
    common_params_sampling p;
    p.seed = sp.seed;
    p.temp = sp.temperature;
    p.top_k = sp.top_k;
    p.top_p = sp.top_p;
    p.min_p = sp.min_p;
    p.penalty_last_n = sp.penalty_last_n;
    p.penalty_repeat = sp.repetition_penalty;
    p.penalty_present = sp.presence_penalty;
    p.penalty_freq = sp.frequency_penalty;
    p.no_perf = true;
    if (sp.ignore_eos) {
        for (int32_t t : model.info().eog_tokens) {
            p.logit_bias.push_back({t, -std::numeric_limits<float>::infinity()});
        }
    }
    for (const auto & [token, bias] : sp.logit_bias) {
        if (token >= model.info().n_vocab) {
            bad("logit_bias token id " + std::to_string(token) + " outside [0, " +
                std::to_string(model.info().n_vocab) + ")");
        }
        p.logit_bias.push_back({token, bias});
    }
    std::string grammar = sp.grammar;
    if (!sp.json_schema.empty()) {
        try {
            grammar = json_schema_to_grammar(common_json::parse(sp.json_schema));
        } catch (const std::exception & e) {
            bad(std::string("invalid JSON schema: ") + e.what());
        }
    }
    if (!grammar.empty()) {
        p.grammar = common_grammar(COMMON_GRAMMAR_TYPE_USER, grammar);
    }
    common_sampler * s = nullptr;
    try {
        s = common_sampler_init(model.get(), p);
    } catch (const std::exception & e) {
        bad(std::string("invalid sampling parameters: ") + e.what());
    }
    if (s == nullptr) bad(grammar.empty() ? "could not create the sampler" : "invalid grammar");
    return common_sampler_ptr(s);
}

}  // namespace

SequenceSampler::SequenceSampler(const Model & model, const SamplerParams & params)
    : n_vocab_(model.info().n_vocab),
      eog_(model.info().eog_tokens),
      plain_greedy_(is_plain_greedy(params)),
      ignore_eos_(params.ignore_eos),
      n_logprobs_(params.n_logprobs) {
    validate_sampler_params(params);
    chain_ = make_chain(model, params);
    std::sort(eog_.begin(), eog_.end());
}

void SequenceSampler::replay(const std::vector<llama_token> & prompt, const std::vector<llama_token> & generated) {
    for (llama_token t : prompt) common_sampler_accept(chain_.get(), t, false);
    for (llama_token t : generated) common_sampler_accept(chain_.get(), t, true);
}

llama_token SequenceSampler::argmax(const float * logits) const {
    const llama_token best = first_argmax(logits, n_vocab_);
    if (!(ignore_eos_ && std::binary_search(eog_.begin(), eog_.end(), best))) return best;
    // the same token as the greedy chain, whose logit bias removes EOG under ignore_eos
    return first_argmax_without(logits, n_vocab_, eog_);
}

std::vector<llama_token> SequenceSampler::verify(llama_context * ctx, const std::vector<int> & rows,
                                                 const std::vector<llama_token> & draft) {
    if (!plain_greedy_) {
        return common_sampler_sample_and_accept_n(chain_.get(), ctx, rows, draft);
    }
    std::vector<llama_token> out;
    for (size_t i = 0; i < rows.size(); ++i) {
        out.push_back(argmax(llama_get_logits_ith(ctx, rows[i])));
        if (i == draft.size() || draft[i] != out.back()) break;
    }
    return out;
}

}  // namespace engine
