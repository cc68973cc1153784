/* LoongSage UI: the gateway's session list and trajectory viewer, and trainer.view's run page.
 *
 * Vanilla JS, no build step, no library. Every node that holds data is built by h() from text
 * nodes, never from markup (innerHTML is not used anywhere), and links are only URLs built here,
 * so nothing a model or an agent wrote can become markup or code. The token (admin token or a
 * session's key) comes from the URL fragment or the form, lives in this tab's sessionStorage and
 * travels only in the Authorization header of fetch() (see gateway/server/ui.py for why).
 */
'use strict';
(() => {
  const TOKEN_KEY = 'loongsage.ui.token';
  const CHUNK = 1000; // token spans built between two looks at the clock
  const SLICE_MS = 150; // build for this long, then let the browser paint and handle input
  const POLL_MS = 1000;
  const LONG_INPUT = 600; // prompt blocks longer than this (tokens) scroll in their own box
  const LP_EDGES = [-0.05, -0.25, -0.5, -1, -2, -4, -8]; // logprob colour buckets lp0..lp7
  const app = document.getElementById('app');
  const tip = document.getElementById('tip');

  // ---------------------------------------------------------------------------------------------
  // Small helpers

  /** An element; string children become text nodes (so they are never parsed as markup). */
  function h(tag, props, ...kids) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v == null || v === false) continue;
      if (k === 'class') el.className = v;
      else if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
      else if (k in el && typeof v !== 'string') el[k] = v;
      else el.setAttribute(k, v === true ? '' : v);
    }
    for (const kid of kids.flat(Infinity)) {
      if (kid == null || kid === false) continue;
      el.append(kid instanceof Node ? kid : String(kid));
    }
    return el;
  }
  function svg(tag, attrs, ...kids) {
    const el = document.createElementNS('http://www.w3.org/2000/svg', tag);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
    for (const kid of kids) el.append(kid instanceof Node ? kid : String(kid));
    return el;
  }
  const yieldToBrowser = () => new Promise((resolve) => setTimeout(resolve, 0));
  const num = (x, digits = 3) =>
    x == null ? '\u2014' : Number.isInteger(x) ? String(x) : Number(x).toFixed(digits);
  const rewardText = (x) => (x == null ? '\u2014' : Number(x).toFixed(3));
  const versionText = (v) => (v == null ? '\u2014' : v[0] === v[1] ? `v${v[0]}` : `v${v[0]}\u2013v${v[1]}`);
  function ago(t) {
    if (!t) return '\u2014';
    const s = Date.now() / 1000 - t;
    if (s < 60) return `${Math.max(0, Math.round(s))} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${Math.round(s / 3600)} h ago`;
    return new Date(t * 1000).toLocaleString();
  }
  function pretty(text) {
    try {
      return JSON.stringify(JSON.parse(text), null, 2);
    } catch (e) {
      return text;
    }
  }
  const badge = (status) => h('span', { class: `st st-${status}` }, status);
  function pageUrl(params) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(params)) if (v != null && v !== '') q.set(k, v);
    const s = q.toString();
    return '/ui' + (s ? `?${s}` : '');
  }
  function setWhere(...parts) {
    document.getElementById('where').replaceChildren(...parts.flatMap((p, i) => (i ? [' / ', p] : [p])));
  }
  function setLive(text, on) {
    const el = document.getElementById('live');
    el.textContent = text || '';
    el.className = on ? 'on' : '';
  }

  // ---------------------------------------------------------------------------------------------
  // Token and API

  function takeTokenFromUrl() {
    const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
      history.replaceState(null, '', location.pathname + location.search);
    }
  }
  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }
  async function fetchAuthed(path) {
    const token = sessionStorage.getItem(TOKEN_KEY);
    const headers = token ? { Authorization: `Bearer ${token}` } : {};
    const r = await fetch(path, { headers, cache: 'no-store' });
    if (!r.ok) {
      let message = r.statusText;
      try {
        message = (await r.json()).error.message;
      } catch (e) { /* not JSON */ }
      throw new HttpError(r.status, message);
    }
    return r;
  }
  const api = async (path) => (await fetchAuthed(path)).json();

  function loginView(message) {
    setWhere('sign in');
    const input = h('input', { type: 'password', name: 'token', autocomplete: 'off', autofocus: true });
    const form = h(
      'form',
      { class: 'login' },
      h('b', null, 'Open the LoongSage viewer'),
      message ? h('p', { class: 'err' }, message) : null,
      h('label', null, 'Admin token (all sessions) or a session\u2019s API key (that session only)'),
      input,
      h('button', { type: 'submit' }, 'Open'),
      h('p', { class: 'muted' }, 'Kept in this tab only. You can also open /ui#token=\u2026'),
    );
    form.addEventListener('submit', (e) => {
      e.preventDefault();
      if (input.value.trim()) {
        sessionStorage.setItem(TOKEN_KEY, input.value.trim());
        location.reload();
      }
    });
    app.replaceChildren(form);
  }
  function errorView(e) {
    app.replaceChildren(h('p', { class: 'err', 'data-error': String(e.status || '') }, `${e.status || ''} ${e.message}`));
  }

  // ---------------------------------------------------------------------------------------------
  // One trajectory

  function lpBucket(lp) {
    let b = 0;
    while (b < LP_EDGES.length && lp < LP_EDGES[b]) b++;
    return b;
  }

  class TrajectoryView {
    /** Renders trajectory views (gateway.server.ui.trajectory_view) into `root`; render() again
     * with a newer view of the same trajectory re-renders only the segments that changed. */
    constructor(root, options = {}) {
      this.root = root;
      this.compact = !!options.compact;
      this.gen = 0;
      this.view = null;
      this.segEls = [];
      this.built = []; // per segment: the signature it was completely built from
      this.mode = 'lp';
      this.head = h('div');
      this.turnsEl = h('div');
      this.segsEl = h('div', { class: 'mode-lp' });
      this.pin = null;
      root.classList.add('traj');
      root.replaceChildren(this.head, this.controls(), this.turnsEl, this.segsEl);
      this.segsEl.addEventListener('mouseover', (e) => this.hover(e));
      this.segsEl.addEventListener('mousemove', (e) => this.moveTip(e));
      this.segsEl.addEventListener('mouseout', () => (tip.hidden = true));
      this.segsEl.addEventListener('click', (e) => this.pinToken(e));
    }

    controls() {
      const mode = h(
        'select',
        { 'data-control': 'colour' },
        h('option', { value: 'lp' }, 'logprob'),
        h('option', { value: 'ver' }, 'weight version'),
        h('option', { value: 'none' }, 'none'),
      );
      mode.addEventListener('change', () => {
        this.segsEl.classList.remove(`mode-${this.mode}`);
        this.mode = mode.value;
        this.segsEl.classList.add(`mode-${this.mode}`);
      });
      const outline = h('input', { type: 'checkbox', 'data-control': 'outline' });
      outline.addEventListener('change', () => this.segsEl.classList.toggle('outline', outline.checked));
      const legend = h(
        'span',
        { class: 'legend', title: 'behaviour logprob of each trained token' },
        'logprob ',
        ['\u2265-0.05', '-0.25', '-0.5', '-1', '-2', '-4', '-8', '<-8'].map((label, i) =>
          h('span', { class: 'sw', style: null, 'data-lp': i }, label),
        ),
      );
      // swatch colours come from the stylesheet (no inline styles under the CSP)
      legend.querySelectorAll('.sw').forEach((el, i) => el.classList.add('tk', 'tr', `lp${i}`));
      const legendBox = h('span', { class: 'mode-lp' }, legend);
      return h(
        'div',
        { class: 'controls' },
        h('label', null, 'colour ', mode),
        h('label', null, outline, ' token boundaries'),
        legendBox,
        h('span', { class: 'muted' }, 'trained tokens are coloured; prompt and tool tokens are grey; hover or click a token for its id, logprob and version'),
      );
    }

    header(v) {
      const stat = (label, value, key) => h('div', null, h('dt', null, label), h('dd', { 'data-stat': key }, value));
      const json = (label, obj) =>
        obj && Object.keys(obj).length
          ? h('details', { class: 'json' }, h('summary', null, label), h('pre', null, JSON.stringify(obj, null, 2)))
          : null;
      const status = v.status;
      return h(
        'div',
        { class: 'hero' },
        h(
          'div',
          { class: 'title' },
          badge(status),
          h('span', { class: 'sid', 'data-field': 'id' }, v.id),
          v.step != null ? h('span', { class: 'muted' }, `step ${v.step}`) : null,
          h('span', { class: 'reward', 'data-field': 'reward' }, h('small', null, 'reward'), rewardText(v.reward)),
        ),
        v.reason ? h('div', { class: `reason st-${status}`, 'data-field': 'reason' }, `${status}: ${v.reason}`) : null,
        h(
          'dl',
          { class: 'stats' },
          stat('turns', v.stats.turns, 'turns'),
          stat('segments', v.segments.length, 'segments'),
          stat('tokens', '\u2026', 'tokens'),
          stat('trained tokens', '\u2026', 'trained'),
          stat('weight versions', v.stats.versions.length ? v.stats.versions.map((x) => `v${x}`).join(' ') : '\u2014', 'versions'),
          stat('version changes', '\u2026', 'vchanges'),
          stat('forks', v.forks, 'forks'),
          v.requests_in_flight != null ? stat('in flight', v.requests_in_flight, 'inflight') : null,
          v.created_at ? stat('created', ago(v.created_at), 'created') : null,
        ),
        json('metadata', v.metadata),
        json('info (attached with the reward)', v.info),
      );
    }

    turnsTable(v) {
      if (!v.turns.length) return h('div');
      const rows = v.turns.map((t, i) =>
        h(
          'tr',
          {
            class: (t.segment == null ? 'undelivered' : 'go'),
            title: t.segment == null ? 'not delivered: the client never got this reply, so it is not in the segments' : 'show this turn',
            onclick: () => {
              const el = this.segsEl.querySelector(`[data-turn="${i}"]`);
              if (el) el.scrollIntoView({ behavior: 'smooth', block: 'center' });
            },
          },
          h('td', { class: 'num' }, i + 1),
          h('td', { class: 'num' }, t.segment == null ? '\u2014' : t.segment + 1),
          h('td', { class: 'num' }, t.start),
          h('td', { class: 'num' }, t.end - t.start),
          h('td', null, t.finish_reason || ''),
          h('td', null, (t.tool_calls || []).map((c) => c.name).join(', ')),
          h('td', null, versionText(t.versions)),
          h('td', null, t.endpoint || ''),
          h('td', { class: 'num' }, t.duration_s != null ? `${num(t.duration_s, 2)} s` : ''),
          h('td', null, t.delivered === false ? 'no' : 'yes'),
        ),
      );
      return h(
        'details',
        { class: 'turns', open: !this.compact && v.turns.length <= 40 },
        h('summary', null, `${v.turns.length} turns`),
        h(
          'table',
          { class: 'grid' },
          h('thead', null, h('tr', null, ['#', 'segment', 'prompt', 'output', 'finish', 'tool calls', 'versions', 'endpoint', 'time', 'delivered'].map((c) => h('th', null, c)))),
          h('tbody', null, rows),
        ),
      );
    }

    async render(v) {
      const gen = ++this.gen;
      const started = performance.now();
      this.lastYield = started;
      this.view = v;
      this.root.dataset.ready = 'false';
      const head = this.header(v);
      this.head.replaceWith(head);
      this.head = head;
      const turns = this.turnsTable(v);
      this.turnsEl.replaceWith(turns);
      this.turnsEl = turns;
      if (v.text != null && !v.segments.length) {  // an old sample: decoded text only
        this.segsEl.replaceChildren(h('section', { class: 'seg' }, h('h3', null, 'text (this sample has no token ids)'), h('div', { class: 'plain' }, v.text)));
      }
      // a segment is rebuilt only when it changed: its length or its turns
      const signature = (k) => `${v.segments[k].ids.length} ${JSON.stringify(v.turns.filter((t) => t.segment === k))}`;
      while (this.segEls.length > v.segments.length) {
        this.segEls.pop().remove();
        this.built.pop();
      }
      for (let k = 0; k < v.segments.length; k++) {
        const sig = signature(k);
        if (this.segEls[k] && this.built[k] === sig) continue;
        const el = h('section', { class: 'seg', 'data-segment': k });
        if (this.segEls[k]) this.segEls[k].replaceWith(el);
        else this.segsEl.append(el);
        this.segEls[k] = el;
        this.built[k] = null;
        await this.renderSegment(el, k, v, gen);
        if (gen !== this.gen) return;
        this.built[k] = sig;  // only once complete
      }
      const count = (sel) => this.segsEl.querySelectorAll(sel).length;
      const set = (key, value) => {
        const el = this.head.querySelector(`[data-stat="${key}"]`);
        if (el) el.textContent = value;
      };
      set('tokens', count('.tk'));
      set('trained', count('.tk.tr'));
      set('vchanges', count('.vmark'));
      this.root.dataset.renderMs = Math.round(performance.now() - started);
      this.root.dataset.ready = 'true';
    }

    blocks(k, v) {
      const seg = v.segments[k];
      const n = seg.ids.length;
      const outs = v.turns
        .map((t, i) => ({ ...t, index: i }))
        .filter((t) => t.segment === k)
        .sort((a, b) => a.start - b.start);
      const blocks = [];
      let pos = 0;
      for (const t of outs) {
        if (t.start > pos) blocks.push({ a: pos, b: t.start, kind: 'in', turn: t });
        blocks.push({ a: t.start, b: t.end, kind: 'out', turn: t });
        pos = t.end;
      }
      if (pos < n) blocks.push({ a: pos, b: n, kind: 'in', turn: null });
      return blocks;
    }

    async renderSegment(el, k, v, gen) {
      const seg = v.segments[k];
      const trained = seg.mask.reduce((a, b) => a + b, 0);
      el.append(h('h3', null, `segment ${k + 1}`, h('span', null, `${seg.ids.length} tokens`), h('span', null, `${trained} trained`)));
      const special = new Set(seg.special);
      let lastVersion = null;
      let built = 0;
      for (const b of this.blocks(k, v)) {
        const toks = h('div', { class: 'toks' });
        toks._seg = k;
        const cards = h('div', { class: 'cards' });
        const t = b.turn;
        let gutter;
        if (b.kind === 'out') {
          const chips = [
            h('span', { class: 'chip' }, `${b.b - b.a} tokens`),
            h('span', { class: 'chip' }, `finish: ${t.finish_reason}`),
            h('span', { class: 'chip' }, versionText(t.versions)),
            t.duration_s != null ? h('span', { class: 'chip' }, `${num(t.duration_s, 2)} s`) : null,
          ];
          gutter = h('div', { class: 'gut' }, h('b', null, `turn ${t.index + 1} \u00b7 model`), chips);
          for (const c of t.tool_calls || []) {
            cards.append(
              h(
                'div',
                { class: c.valid ? 'card call' : 'card call bad' },
                h('div', { class: 'card-h' }, 'tool call ', h('b', null, c.name), c.valid ? null : ' \u2014 malformed: the agent got the raw text as arguments'),
                h('pre', null, pretty(c.arguments)),
              ),
            );
          }
        } else {
          const label = !t ? 'after the last turn' : b.a === 0 ? 'prompt' : 'agent \u2192 model';
          gutter = h(
            'div',
            { class: 'gut' },
            h('b', null, t ? `turn ${t.index + 1} \u00b7 ${label}` : label),
            h('span', { class: 'chip' }, `${b.b - b.a} tokens`),
          );
          if (b.b - b.a > LONG_INPUT) {  // scrolls in a box of its own until expanded
            const toggle = h('button', { type: 'button', class: 'chip', 'data-control': 'expand' }, 'expand');
            toggle.addEventListener('click', () => {
              toggle.textContent = toggle.closest('.blk').classList.toggle('open') ? 'collapse' : 'expand';
            });
            gutter.append(toggle);
          }
          for (const r of (t && t.tool_results) || []) {
            cards.append(h('div', { class: 'card result' }, h('div', { class: 'card-h' }, 'tool result'), h('pre', null, pretty(r))));
          }
        }
        const long = b.kind === 'in' && b.b - b.a > LONG_INPUT ? ' long' : '';
        const blk = h('div', { class: `blk ${b.kind}${long}`, 'data-turn': b.kind === 'out' ? t.index : null }, gutter, h('div', null, toks, cards.childNodes.length ? cards : null));
        el.append(blk);
        let frag = document.createDocumentFragment();
        for (let i = b.a; i < b.b; i++) {
          const text = seg.text[i];
          let cls = 'tk';
          if (seg.mask[i]) {
            const version = seg.ver[i];
            if (lastVersion !== null && version !== lastVersion) {
              frag.append(h('span', { class: 'vmark', title: `weight version changes here: v${lastVersion} \u2192 v${version}` }, `v${lastVersion}\u2192v${version}`));
            }
            lastVersion = version;
            cls += ` tr lp${lpBucket(seg.lp[i])} v${((version % 6) + 6) % 6}`;
          }
          if (special.has(i)) cls += ' sp';
          if (text === '') cls += ' empty';
          else if (text.includes('\n')) cls += ' nl';
          const span = document.createElement('span');
          span.className = cls;
          span.textContent = text;
          span._i = i;
          frag.append(span);
          if (++built % CHUNK === 0 && performance.now() - this.lastYield > SLICE_MS) {
            toks.append(frag);
            frag = document.createDocumentFragment();
            await yieldToBrowser();
            this.lastYield = performance.now();
            if (gen !== this.gen) return;
          }
        }
        toks.append(frag);
      }
    }

    tokenInfo(target) {
      if (!target.classList || !target.classList.contains('tk') || target._i == null) return null;
      const k = target.parentNode._seg;
      const seg = this.view.segments[k];
      const i = target._i;
      const trained = seg.mask[i] === 1;
      const lp = seg.lp[i];
      return {
        position: `segment ${k + 1}, token ${i}`,
        id: seg.ids[i],
        text: JSON.stringify(seg.text[i]),
        kind: trained ? 'trained (sampled by the model)' : 'prompt / tool / template (not trained)',
        logprob: trained ? `${lp.toFixed(4)} (p = ${Math.exp(lp).toFixed(4)})` : '\u2014',
        version: trained ? `v${seg.ver[i]}` : '\u2014',
      };
    }

    hover(e) {
      const info = this.tokenInfo(e.target);
      if (!info) return;
      tip.textContent = `#${info.id} ${info.text}\n${info.kind}\nlogprob ${info.logprob} \u00b7 version ${info.version}`;
      tip.hidden = false;
      this.moveTip(e);
    }

    moveTip(e) {
      if (tip.hidden) return;
      const x = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
      const y = e.clientY + 18 + tip.offsetHeight > window.innerHeight ? e.clientY - tip.offsetHeight - 10 : e.clientY + 18;
      tip.style.left = `${x}px`;
      tip.style.top = `${y}px`;
    }

    pinToken(e) {
      const info = this.tokenInfo(e.target);
      if (!info) return;
      this.root.querySelectorAll('.tk.pinned').forEach((s) => s.classList.remove('pinned'));
      e.target.classList.add('pinned');
      const close = h('button', { type: 'button', onclick: () => { this.pin.remove(); this.pin = null; e.target.classList.remove('pinned'); } }, '\u00d7');
      const pin = h(
        'div',
        { class: 'pin', 'data-pin': '' },
        close,
        h('b', null, 'token'),
        h('dl', null, Object.entries(info).map(([k, val]) => [h('dt', null, k), h('dd', { 'data-key': k }, val)])),
      );
      if (this.pin) this.pin.replaceWith(pin);
      else document.body.append(pin);
      this.pin = pin;
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Gateway pages

  async function listPage(q) {
    setWhere('sessions');
    const state = {
      offset: Number(q.get('offset')) || 0,
      limit: Number(q.get('limit')) || 50,
      status: q.get('status') || 'all',
      sort: q.get('sort') || '-created',
      q: q.get('q') || '',
    };
    const status = h('select', { 'data-control': 'status' });
    const sort = h(
      'select',
      { 'data-control': 'sort' },
      [['-created', 'newest first'], ['created', 'oldest first'], ['-reward', 'reward \u2193'], ['reward', 'reward \u2191'], ['-turns', 'turns \u2193'], ['-tokens', 'tokens \u2193'], ['status', 'status']].map(
        ([value, label]) => h('option', { value, selected: value === state.sort }, label),
      ),
    );
    const search = h('input', { type: 'search', placeholder: 'filter by id or metadata', value: state.q, 'data-control': 'search' });
    const live = h('input', { type: 'checkbox', checked: true, 'data-control': 'live' });
    const info = h('span', { class: 'muted', 'data-field': 'range' });
    const prev = h('button', { type: 'button', 'data-control': 'prev' }, '\u2190 newer');
    const next = h('button', { type: 'button', 'data-control': 'next' }, 'older \u2192');
    const body = h('tbody');
    const columns = ['id', 'status', 'reward', 'turns', 'output tokens', 'context', 'forks', 'endpoint', 'agent', 'versions', 'created', 'in flight'];
    const numeric = new Set(['reward', 'turns', 'output tokens', 'context', 'forks', 'in flight']);
    app.replaceChildren(
      h('div', { class: 'bar' }, h('label', null, 'status ', status), h('label', null, 'sort ', sort), search, h('label', null, live, ' live'), h('span', { class: 'spacer' }), info, prev, next),
      h('table', { class: 'grid', 'data-table': 'sessions' }, h('thead', null, h('tr', null, columns.map((c) => h('th', { class: numeric.has(c) ? 'num' : null }, c)))), body),
    );
    let loading = false;
    async function load() {
      if (loading) return;
      loading = true;
      try {
        const params = new URLSearchParams({ offset: state.offset, limit: state.limit, status: state.status, sort: state.sort, q: state.q });
        const data = await api(`/ui/api/sessions?${params}`);
        const counts = data.counts;
        status.replaceChildren(
          ...['all', 'open', 'ok', 'aborted', 'error'].map((s) =>
            h('option', { value: s, selected: s === state.status }, `${s} (${s === 'all' ? data.all : counts[s] || 0})`),
          ),
        );
        body.replaceChildren(
          ...data.rows.map((r) => {
            const href = pageUrl({ session: r.id });
            return h(
              'tr',
              { class: 'go', 'data-session': r.id, onclick: (e) => { if (e.target.tagName !== 'A') location.href = href; } },
              h('td', { class: 'mono clip' }, h('a', { href }, r.id)),
              h('td', { title: r.reason || null }, badge(r.status)),
              h('td', { class: 'num' }, rewardText(r.reward)),
              h('td', { class: 'num' }, r.turns),
              h('td', { class: 'num' }, r.output_tokens),
              h('td', { class: 'num' }, r.context),
              h('td', { class: 'num' }, r.forks),
              h('td', null, r.endpoints.join(', ')),
              h('td', { class: 'clip' }, r.agent || '\u2014'),
              h('td', null, versionText(r.versions)),
              h('td', { title: new Date(r.created_at * 1000).toLocaleString() }, ago(r.created_at)),
              h('td', { class: 'num' }, r.requests_in_flight),
            );
          }),
        );
        const end = Math.min(data.offset + data.rows.length, data.total);
        info.textContent = data.total ? `${data.offset + 1}\u2013${end} of ${data.total}` : 'no sessions';
        prev.disabled = data.offset === 0;
        next.disabled = end >= data.total;
        setLive(`weight version v${data.weight_version}`, live.checked);
        const keep = {};
        if (state.offset) keep.offset = state.offset;
        if (state.status !== 'all') keep.status = state.status;
        if (state.sort !== '-created') keep.sort = state.sort;
        if (state.q) keep.q = state.q;
        history.replaceState(null, '', pageUrl(keep));
        app.dataset.ready = 'true';
      } catch (e) {
        if (e.status === 401 || e.status === 403) return loginView(e.message);
        info.textContent = `${e.status || ''} ${e.message}`;
      } finally {
        loading = false;
      }
    }
    const reload = () => { state.offset = 0; load(); };
    status.addEventListener('change', () => { state.status = status.value; reload(); });
    sort.addEventListener('change', () => { state.sort = sort.value; reload(); });
    let typing;
    search.addEventListener('input', () => { clearTimeout(typing); typing = setTimeout(() => { state.q = search.value.trim(); reload(); }, 250); });
    prev.addEventListener('click', () => { state.offset = Math.max(0, state.offset - state.limit); load(); });
    next.addEventListener('click', () => { state.offset += state.limit; load(); });
    live.addEventListener('change', () => setLive(document.getElementById('live').textContent, live.checked));
    await load();
    setInterval(() => { if (live.checked && !document.hidden) load(); }, 2000);
  }

  async function sessionPage(sid, who) {
    const crumbs = [];
    if (who.admin) crumbs.push(h('a', { href: '/ui' }, 'sessions'));
    crumbs.push(h('span', { class: 'mono' }, sid));
    setWhere(...crumbs);
    let v;
    try {
      v = await api(`/ui/api/sessions/${encodeURIComponent(sid)}`);
    } catch (e) {
      return errorView(e);
    }
    const root = h('div');
    app.replaceChildren(root);
    const view = new TrajectoryView(root);
    await view.render(v);
    let rev = v.rev;
    const live = (open) => setLive(open ? `live \u00b7 updated ${new Date().toLocaleTimeString()}` : '', open);
    live(v.live);
    const poll = async () => {
      try {
        if (!document.hidden) {
          const r = await api(`/ui/api/sessions/${encodeURIComponent(sid)}?since=${encodeURIComponent(rev)}`);
          if (!r.unchanged) {
            rev = r.rev;
            await view.render(r);
          }
          live(r.unchanged ? true : r.live);
          if (!r.unchanged && !r.live) return;
        }
      } catch (e) {
        setLive(`not updating: ${e.message}`, false);
      }
      setTimeout(poll, POLL_MS);
    };
    if (v.live) setTimeout(poll, POLL_MS);
  }

  // ---------------------------------------------------------------------------------------------
  // Run pages (trainer.view)

  function chart(key, rows) {
    const pts = rows.filter((r) => r[key] != null).map((r) => [r.step, r[key]]);
    const W = 300;
    const H = 120;
    const P = { l: 34, r: 6, t: 6, b: 16 };
    const box = svg('svg', { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: 'none', role: 'img' });
    const last = pts.length ? pts[pts.length - 1][1] : null;
    if (pts.length) {
      const xs = pts.map((p) => p[0]);
      const ys = pts.map((p) => p[1]);
      const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
      let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
      if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
      const X = (x) => P.l + ((x - x0) / (x1 - x0 || 1)) * (W - P.l - P.r);
      const Y = (y) => H - P.b - ((y - y0) / (y1 - y0)) * (H - P.t - P.b);
      box.append(
        svg('line', { x1: P.l, y1: H - P.b, x2: W - P.r, y2: H - P.b }),
        svg('text', { x: 2, y: P.t + 8 }, num(y1)),
        svg('text', { x: 2, y: H - P.b }, num(y0)),
        svg('text', { x: P.l, y: H - 3 }, `step ${x0}`),
        svg('text', { x: W - P.r, y: H - 3, 'text-anchor': 'end' }, `${x1}`),
        svg('polyline', { points: pts.map(([x, y]) => `${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(' ') }),
      );
      if (pts.length <= 80) {
        for (const [x, y] of pts) box.append(svg('circle', { cx: X(x), cy: Y(y), r: 1.8 }, svg('title', null, `step ${x}: ${y}`)));
      }
    }
    return h('div', { class: 'chart', 'data-metric': key }, h('div', { class: 'ch' }, h('b', { title: key }, key), h('span', { class: 'muted' }, `last ${num(last, 4)}`)), box);
  }

  async function runPage(q, who) {
    setWhere(h('span', { class: 'mono' }, who.title || 'run'));
    const run = await api('/ui/api/run');
    const plots = h('div', { class: 'plots' });
    for (const name of run.plots) {
      const img = h('img', { alt: name, 'data-plot': name });
      plots.append(h('figure', null, img, h('figcaption', null, name)));
      fetchAuthed(`/ui/api/plots/${encodeURIComponent(name)}`)
        .then((r) => r.blob())
        .then((b) => { img.src = URL.createObjectURL(b); })
        .catch((e) => img.replaceWith(h('p', { class: 'err' }, e.message)));
    }
    const rows = run.metrics.rows;
    const filter = h('input', { type: 'search', value: 'reward', placeholder: 'metrics matching\u2026', 'data-control': 'metric-filter' });
    const charts = h('div', { class: 'charts' });
    const table = h('div');
    const shown = h('span', { class: 'muted' });
    const drawCharts = () => {
      const f = filter.value.trim().toLowerCase();
      const keys = run.metrics.keys.filter((k) => k.toLowerCase().includes(f));
      shown.textContent = `${keys.length} of ${run.metrics.keys.length} metrics, ${rows.length} steps`;
      charts.replaceChildren(...keys.slice(0, 24).map((k) => chart(k, rows)));
      const cols = keys.slice(0, 8);
      table.replaceChildren(
        h(
          'details',
          null,
          h('summary', null, 'table'),
          h(
            'table',
            { class: 'grid' },
            h('thead', null, h('tr', null, h('th', { class: 'num' }, 'step'), cols.map((c) => h('th', { class: 'num' }, c)))),
            h('tbody', null, rows.map((r) => h('tr', null, h('td', { class: 'num' }, r.step), cols.map((c) => h('td', { class: 'num' }, num(r[c], 4)))))),
          ),
        ),
      );
    };
    filter.addEventListener('input', drawCharts);
    drawCharts();

    // samples
    const stepSel = h('select', { 'data-control': 'step' }, h('option', { value: '' }, 'all steps'), run.steps.map((s) => h('option', { value: s }, `step ${s}`)));
    const statusSel = h('select', { 'data-control': 'status' }, ['', 'ok', 'aborted', 'error'].map((s) => h('option', { value: s }, s || 'any status')));
    const sortSel = h('select', { 'data-control': 'sort' }, [['step', 'step \u2191'], ['-step', 'step \u2193'], ['-reward', 'reward \u2193'], ['reward', 'reward \u2191']].map(([v, l]) => h('option', { value: v }, l)));
    const minReward = h('input', { type: 'number', step: 'any', placeholder: 'min reward', 'data-control': 'min-reward', size: 8 });
    const body = h('tbody');
    const range = h('span', { class: 'muted', 'data-field': 'range' });
    const prev = h('button', { type: 'button' }, '\u2190');
    const next = h('button', { type: 'button' }, '\u2192');
    const compareBtn = h('button', { type: 'button', disabled: true, 'data-control': 'compare' }, 'compare 2 selected');
    const stepA = h('select', { 'data-control': 'step-a' }, run.steps.map((s) => h('option', { value: s }, `step ${s}`)));
    const stepB = h('select', { 'data-control': 'step-b' }, run.steps.map((s, i) => h('option', { value: s, selected: i === run.steps.length - 1 }, `step ${s}`)));
    const compareSteps = h('button', { type: 'button', disabled: !run.steps.length, 'data-control': 'compare-steps' }, 'compare');
    const chosen = new Set();
    let offset = 0;
    const limit = 50;
    async function loadSamples() {
      const params = new URLSearchParams({ offset, limit, sort: sortSel.value });
      if (stepSel.value !== '') params.set('step', stepSel.value);
      if (statusSel.value) params.set('status', statusSel.value);
      if (minReward.value !== '') params.set('min_reward', minReward.value);
      const data = await api(`/ui/api/samples?${params}`);
      body.replaceChildren(
        ...data.rows.map((r) => {
          const box = h('input', { type: 'checkbox', checked: chosen.has(r.index), 'data-index': r.index });
          box.addEventListener('change', () => {
            if (box.checked) chosen.add(r.index); else chosen.delete(r.index);
            compareBtn.disabled = chosen.size !== 2;
          });
          const href = pageUrl({ sample: r.index });
          return h(
            'tr',
            { 'data-sample': r.index },
            h('td', null, box),
            h('td', { class: 'num' }, h('a', { href }, r.index)),
            h('td', { class: 'num' }, r.step),
            h('td', { class: 'num' }, rewardText(r.reward)),
            h('td', { title: r.reason || null }, badge(r.status)),
            h('td', { class: 'num' }, r.turns),
            h('td', { class: 'num' }, r.tokens),
            h('td', { class: 'num' }, r.trained),
            h('td', null, r.versions.length ? r.versions.map((x) => `v${x}`).join(' ') : '\u2014'),
            h('td', { class: 'clip' }, r.reason || ''),
          );
        }),
      );
      const end = data.offset + data.rows.length;
      range.textContent = data.total ? `${data.offset + 1}\u2013${end} of ${data.total}` : 'no samples';
      prev.disabled = offset === 0;
      next.disabled = end >= data.total;
      app.dataset.ready = 'true';
    }
    for (const el of [stepSel, statusSel, sortSel, minReward]) el.addEventListener('change', () => { offset = 0; loadSamples(); });
    prev.addEventListener('click', () => { offset = Math.max(0, offset - limit); loadSamples(); });
    next.addEventListener('click', () => { offset += limit; loadSamples(); });
    compareBtn.addEventListener('click', () => { location.href = pageUrl({ compare: [...chosen].join(',') }); });
    compareSteps.addEventListener('click', async () => {
      const first = async (step) => (await api(`/ui/api/samples?step=${step}&limit=1&sort=-reward`)).rows[0];
      const [a, b] = await Promise.all([first(stepA.value), first(stepB.value)]);
      if (a && b) location.href = pageUrl({ compare: `${a.index},${b.index}` });
    });

    app.replaceChildren(
      h('div', { class: 'hero' }, h('div', { class: 'title' }, h('span', { class: 'sid' }, run.name), h('span', { class: 'muted' }, run.dir)),
        h('dl', { class: 'stats' }, Object.entries(run.summary).map(([k, val]) => h('div', null, h('dt', null, k), h('dd', null, String(val))))),
        run.config ? h('details', { class: 'json' }, h('summary', null, 'config.yaml'), h('pre', null, run.config)) : null),
      h('h2', null, 'Plots'),
      run.plots.length ? plots : h('p', { class: 'muted' }, 'no plots yet (a run writes them when it ends)'),
      h('h2', null, 'Metrics over steps'),
      h('div', { class: 'bar' }, filter, shown),
      charts,
      table,
      h('h2', null, 'Samples'),
      h('div', { class: 'bar' }, stepSel, statusSel, sortSel, minReward, h('span', { class: 'spacer' }), range, prev, next),
      h('div', { class: 'bar' }, compareBtn, h('span', { class: 'muted' }, 'or the best sample of'), stepA, h('span', { class: 'muted' }, 'vs'), stepB, compareSteps),
      h('table', { class: 'grid', 'data-table': 'samples' },
        h('thead', null, h('tr', null, ['', '#', 'step', 'reward', 'status', 'turns', 'tokens', 'trained', 'versions', 'reason'].map((c) => h('th', null, c)))),
        body),
    );
    await loadSamples();
  }

  async function samplePages(indices, who) {
    setWhere(h('a', { href: '/ui' }, who.title || 'run'), indices.length > 1 ? 'compare' : `sample ${indices[0]}`);
    const views = await Promise.all(indices.map((i) => api(`/ui/api/samples/${encodeURIComponent(i)}`)));
    const roots = views.map(() => h('div'));
    app.replaceChildren(indices.length > 1 ? h('div', { class: 'compare' }, roots) : roots[0]);
    await Promise.all(views.map((v, i) => new TrajectoryView(roots[i], { compact: indices.length > 1 }).render(v)));
    app.dataset.ready = 'true';
  }

  // ---------------------------------------------------------------------------------------------

  async function main() {
    takeTokenFromUrl();
    window.addEventListener('hashchange', () => {  // a new #token=... on this same page
      if (/(?:^#|&)token=/.test(location.hash)) {
        takeTokenFromUrl();
        location.reload();
      }
    });
    const forget = document.getElementById('forget');
    forget.addEventListener('click', () => { sessionStorage.removeItem(TOKEN_KEY); location.reload(); });
    let who;
    try {
      who = await api('/ui/api/whoami');
    } catch (e) {
      if (e.status === 401) return loginView(sessionStorage.getItem(TOKEN_KEY) ? e.message : null);
      return errorView(e);
    }
    forget.hidden = false;
    const q = new URLSearchParams(location.search);
    try {
      if (who.kind === 'run') {
        if (q.get('sample')) return await samplePages([q.get('sample')], who);
        if (q.get('compare')) return await samplePages(q.get('compare').split(',').slice(0, 2), who);
        return await runPage(q, who);
      }
      if (q.get('session')) return await sessionPage(q.get('session'), who);
      if (who.admin) return await listPage(q);
      location.replace(pageUrl({ session: who.session }));
    } catch (e) {
      errorView(e);
    }
  }
  main();
})();
