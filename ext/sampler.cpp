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
    if (!sp.chat.grammar.empty() && !(sp.grammar.empty() && sp.json_schema.empty())) {
        bad("a chat template's grammar (tools) takes the place of grammar and json_schema: give one");
    }
    for (const auto & t : sp.chat.triggers) {
        if (t.type < COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN || t.type > COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL) {
            bad("unknown grammar trigger type " + std::to_string(t.type));
        }
    }
    if (sp.chat.lazy && sp.chat.triggers.empty()) bad("a lazy grammar needs triggers");
    if (sp.min_tokens < 0) bad("min_tokens must be >= 0, got " + std::to_string(sp.min_tokens));
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
           p.frequency_penalty == 0.0f && p.grammar.empty() && p.json_schema.empty() && p.chat.grammar.empty() &&
           p.logit_bias.empty();
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
    const ChatGrammar & chat = sp.chat;
    if (!chat.grammar.empty()) {  // as llama-server sets up a template's tool-call grammar
        const int32_t n_vocab = model.info().n_vocab;
        auto check = [&](int32_t t) {
            if (t < 0 || t >= n_vocab) bad("chat grammar token " + std::to_string(t) + " outside the vocabulary");
        };
        p.grammar = common_grammar(COMMON_GRAMMAR_TYPE_TOOL_CALLS, chat.grammar);
        p.grammar_lazy = chat.lazy;
        for (const auto & t : chat.triggers) {
            if (t.type == COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN) check(t.token);
            p.grammar_triggers.push_back({static_cast<common_grammar_trigger_type>(t.type), t.value, t.token});
        }
        for (int32_t t : chat.preserved_tokens) {
            check(t);
            p.preserved_tokens.insert(t);
        }
        p.generation_prompt = chat.generation_prompt;
        if (!chat.thinking_start.empty() && !chat.thinking_end.empty()) {
            for (int32_t t : chat.thinking_start) check(t);
            p.reasoning_budget_start = chat.thinking_start;
            p.reasoning_budget_end = chat.thinking_end;
            p.reasoning_budget_tokens = -1;  // no budget: the tags only keep the grammar out of the thinking
        }
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
      n_logprobs_(params.n_logprobs),
      special_(params.special),
      preserved_(params.chat.preserved_tokens) {
    validate_sampler_params(params);
    chain_ = make_chain(model, params);
    min_tokens_ = params.min_tokens;
    if (min_tokens_ > 0) {
        early_stops_ = model.info().eog_tokens;
        for (int32_t t : params.min_tokens_suppress) {
            if (t >= 0 && t < n_vocab_) early_stops_.push_back(t);
        }
    }
    std::sort(eog_.begin(), eog_.end());
    std::sort(preserved_.begin(), preserved_.end());
}

void SequenceSampler::replay(const std::vector<llama_token> & prompt, const std::vector<llama_token> & generated) {
    for (llama_token t : prompt) common_sampler_accept(chain_.get(), t, false);
    for (llama_token t : generated) common_sampler_accept(chain_.get(), t, true);
    n_generated_ = static_cast<int32_t>(generated.size());
}

void SequenceSampler::suppress_early_stops(llama_context * ctx, const std::vector<int> & rows) const {
    for (size_t i = 0; i < rows.size() && n_generated_ + static_cast<int32_t>(i) < min_tokens_; ++i) {
        float * logits = llama_get_logits_ith(ctx, rows[i]);
        for (llama_token t : early_stops_) logits[t] = -std::numeric_limits<float>::infinity();
    }
}

llama_token SequenceSampler::argmax(const float * logits) const {
    const llama_token best = first_argmax(logits, n_vocab_);
    if (!(ignore_eos_ && std::binary_search(eog_.begin(), eog_.end(), best))) return best;
    // the same token as the greedy chain, whose logit bias removes EOG under ignore_eos
    return first_argmax_without(logits, n_vocab_, eog_);
}

std::vector<llama_token> SequenceSampler::verify(llama_context * ctx, const std::vector<int> & rows,
                                                 const std::vector<llama_token> & draft) {
    if (n_generated_ < min_tokens_) suppress_early_stops(ctx, rows);
    std::vector<llama_token> out;
    if (!plain_greedy_) {
        out = common_sampler_sample_and_accept_n(chain_.get(), ctx, rows, draft);
    } else {
        for (size_t i = 0; i < rows.size(); ++i) {
            out.push_back(argmax(llama_get_logits_ith(ctx, rows[i])));
            if (i == draft.size() || draft[i] != out.back()) break;
        }
    }
    n_generated_ += static_cast<int32_t>(out.size());
    return out;
}

}  // namespace engine
